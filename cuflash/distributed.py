"""Context-parallel ring attention: the sequence sharded over ranks, K/V blocks passed around a ring.

Each of `world` ranks holds its shard (along dim 1, the sequence) of q, k and v. In `world` steps
every K/V shard visits every rank; at each step a rank attends its local queries to the visiting
block with cuflash.flash_attn_forward and merges the result into its running (o, lse) by the
log-sum-exp rule (cuflash._merge). The result is exact attention of the local queries over the
whole sequence: o in q's dtype, lse float32 (float64 for float64), like flash_attn_forward.

Backward: each step recomputes the visiting block's contribution with flash_attn_backward given
the GLOBAL o and lse (P = exp(S - LSE_global) and D = rowsum(dO * O_global) are then the global
ones, so the per-block dq, dk, dv are exact partial sums). dq accumulates locally; the dk/dv partial
sums travel with their K/V block (one step behind it, so that sending them overlaps the next step's
compute) and reach the block's owner after a full turn. Accumulators are float32 (float64 for
float64) and travel as such.

Causal attention uses zig-zag sharding for balance: the global sequence of N = 2 * world * c tokens
is cut into 2 * world chunks of c tokens, and rank r holds chunks r and 2*world-1-r, concatenated
(`zigzag_shard`, `zigzag_unshard`). Each (query chunk, key chunk) pair is full attention when the
key chunk comes first, causal on the diagonal, skipped when the key chunk comes later; the pairs of
a step are coalesced into as few flash_attn calls as possible (`step_tasks`). Non-causal attention
takes any equal-length contiguous sharding.

Communication goes through a `comm` object with `rank`, `world` and
`sendrecv(send_arrays, dst, src) -> recv_arrays` (and, optionally, `start_sendrecv(...)` returning a
handle whose `wait()` gives the received arrays, for overlap). Two are provided:

- `NcclRing(nccl_comm, rank, world, stream=None)`: cupy.cuda.nccl send/recv (grouped) on a
  communication stream, ordered against the compute (current) stream by CUDA events, so that the
  next block travels while the current one is attended (double buffer). The launcher must set
  NCCL_NVLS_ENABLE=0 (NVLink multicast off) before NCCL initializes; bench/ring.py does.
- `SimulatedRing(world)`: every rank in one process. `simulate_ring_forward` /
  `simulate_ring_backward` run the very same per-rank step code (`_forward_rank`, `_backward_rank`,
  generators that yield their communication requests) for all ranks in lockstep, and move blocks
  between ranks by list rotation. For tests and for timing the compute of the schedule alone.

Arrays: NumPy or CuPy (one kind for all inputs); the backend is cuflash's (`backend="auto"`, "cuda",
"numpy", ...). All ranks' shards have the same shapes.
"""

from __future__ import annotations

import numpy as np

from . import _checks, _interop
from ._merge import _dtype_name, from_acc, merge_into, to_acc
from .api import flash_attn_backward, flash_attn_forward
from .config import DTYPES, acc_dtype

__all__ = ["ring_attention", "ring_attention_forward", "ring_attention_backward", "simulate_ring_forward",
           "simulate_ring_backward", "zigzag_shard", "zigzag_unshard", "step_tasks", "SimulatedRing", "NcclRing"]


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def _xp(x):
    if _interop.is_cupy(x):
        import cupy

        return cupy
    if _interop.is_numpy(x):
        return np
    raise TypeError(f"ring attention takes NumPy or CuPy arrays, got {type(x).__name__}")


_ALL = slice(None)


def _bits(x):
    """A 16-bit view of a bfloat16 array (CuPy copies and concatenates bfloat16 only as raw bits)."""
    return x.view(np.uint16) if _dtype_name(x) == "bfloat16" else x


def _contig(x, xp):
    """x as a C-contiguous array (a copy only where x is not), every dtype."""
    if x.flags.c_contiguous:
        return x
    return xp.ascontiguousarray(_bits(x)).view(x.dtype)


def _copy(x, xp):
    return xp.array(_bits(x), copy=True).view(x.dtype)


def _concat(parts, axis, xp):
    return xp.concatenate([_bits(p) for p in parts], axis=axis).view(parts[0].dtype)


def _cut(x, sl, xp):
    """x[:, sl] (sequence dim 1), contiguous."""
    return x if sl == _ALL else _contig(x[:, sl], xp)


def _cut_lse(x, sl, xp):
    return x if sl == _ALL else _contig(x[:, :, sl], xp)


def _check_shards(q, k, v, causal, what="ring attention"):
    for name, x in (("q", q), ("k", k), ("v", v)):
        _xp(x)
        if x.ndim != 4:
            raise ValueError(f"{what}: {name} must be 4-D (batch, seqlen, heads, head_dim), got shape {tuple(x.shape)}")
    kinds = {_xp(x).__name__ for x in (q, k, v)}
    if len(kinds) > 1:
        raise TypeError(f"{what}: q, k, v must all be NumPy or all CuPy arrays")
    name = _dtype_name(q)
    if name not in DTYPES:
        raise TypeError(f"{what}: dtype must be one of {', '.join(DTYPES)}, got {name}")
    for n, x in (("k", k), ("v", v)):
        if _dtype_name(x) != name:
            raise TypeError(f"{what}: {n} has dtype {_dtype_name(x)}, q has {name}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"{what}: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"{what}: q {tuple(q.shape)} and k {tuple(k.shape)} do not match (batch, head_dim, "
                         "and nheads a multiple of nheads_k)")
    if causal:
        if q.shape[1] != k.shape[1] or q.shape[1] % 2:
            raise ValueError(f"{what}: causal (zig-zag) shards need equal, even local q and k lengths, "
                             f"got {q.shape[1]} and {k.shape[1]}")
    return name


def _check_world(rank, world):
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")


# ------------------------------------------------------------------------------------------------
# zig-zag sharding and the per-step chunk plan
# ------------------------------------------------------------------------------------------------

def zigzag_shard(x, rank: int, world: int, dim: int = 1):
    """Rank `rank`'s zig-zag shard of x along `dim`: chunks rank and 2*world-1-rank of 2*world equal
    chunks, concatenated (a copy)."""
    _check_world(rank, world)
    xp = _xp(x)
    n = x.shape[dim]
    if n % (2 * world):
        raise ValueError(f"zigzag_shard: length {n} along dim {dim} is not a multiple of 2 * world = {2 * world}")
    c = n // (2 * world)
    idx = [_ALL] * x.ndim
    parts = []
    for ch in (rank, 2 * world - 1 - rank):
        idx[dim] = slice(ch * c, (ch + 1) * c)
        parts.append(x[tuple(idx)])
    return _concat(parts, dim, xp)


def zigzag_unshard(shards, dim: int = 1):
    """The global array from all ranks' zig-zag shards (shards[r] from rank r)."""
    shards = list(shards)
    world = len(shards)
    if world == 0:
        raise ValueError("zigzag_unshard: no shards")
    xp = _xp(shards[0])
    n = shards[0].shape[dim]
    if n % 2 or any(s.shape[dim] != n for s in shards):
        raise ValueError("zigzag_unshard: shards need one even length along dim")
    c = n // 2
    chunks = [None] * (2 * world)
    idx = [_ALL] * shards[0].ndim
    for r, s in enumerate(shards):
        for half, ch in enumerate((r, 2 * world - 1 - r)):
            idx[dim] = slice(half * c, (half + 1) * c)
            chunks[ch] = s[tuple(idx)]
    return _concat(chunks, dim, xp)


def step_tasks(rank: int, src: int, world: int, local_len: int, causal: bool):
    """The attention calls of one step: rank's queries against the block of rank `src`.

    A list of (q_slice, k_slice, causal) over the local sequence positions. Non-causal: the whole
    block. Causal (zig-zag): from the (query chunk, key chunk) pairs, full when the key chunk comes
    first, causal on the diagonal, nothing when it comes later, coalesced into as few calls as can
    be: the diagonal step is one causal call, the others one full call each."""
    if not causal:
        return [(_ALL, _ALL, False)]
    c = local_len // 2
    qch = (rank, 2 * world - 1 - rank)
    kch = (src, 2 * world - 1 - src)
    mode = [["full" if kc < qc else "diag" if kc == qc else "skip" for kc in kch] for qc in qch]
    if mode == [["diag", "skip"], ["full", "diag"]]:  # the block's own chunks: one causal call
        return [(_ALL, _ALL, True)]
    per_q = []
    for a in range(2):
        tasks = []
        full = [b for b in range(2) if mode[a][b] == "full"]
        if len(full) == 2:
            tasks.append((_ALL, False))
        elif full:
            tasks.append((slice(full[0] * c, (full[0] + 1) * c), False))
        for b in range(2):
            if mode[a][b] == "diag":
                tasks.append((slice(b * c, (b + 1) * c), True))
        per_q.append(tasks)
    if per_q[0] == per_q[1]:
        return [(_ALL, ks, cz) for ks, cz in per_q[0]]
    return [(slice(a * c, (a + 1) * c), ks, cz) for a in range(2) for ks, cz in per_q[a]]


# ------------------------------------------------------------------------------------------------
# per-rank step code (generators: they yield ("start", arrays) and ("wait", handle) requests)
# ------------------------------------------------------------------------------------------------

def _forward_rank(q, k, v, rank, world, causal, softmax_scale, backend):
    """One rank's ring forward; returns (o, lse) of the local queries over the whole sequence."""
    xp = _xp(q)
    name = _dtype_name(q)
    b, s, h, d = q.shape
    acc = acc_dtype(name)
    o_acc = xp.zeros((b, s, h, d), dtype=acc)
    lse_acc = xp.full((b, h, s), -xp.inf, dtype=acc)
    kb, vb = k, v
    for step in range(world):
        src = (rank - step) % world
        handle = (yield ("start", (kb, vb))) if step < world - 1 else None  # the next block travels
        for qs, ks, cz in step_tasks(rank, src, world, s, causal):
            o_t, l_t = flash_attn_forward(_cut(q, qs, xp), _cut(kb, ks, xp), _cut(vb, ks, xp), causal=cz,
                                          softmax_scale=softmax_scale, backend=backend)
            if qs == _ALL:
                o_acc, lse_acc = merge_into(o_acc, lse_acc, o_t, l_t, xp)
            else:
                o_new, l_new = merge_into(o_acc[:, qs], lse_acc[:, :, qs], o_t, l_t, xp)
                o_acc[:, qs] = o_new
                lse_acc[:, :, qs] = l_new
        if handle is not None:
            kb, vb = yield ("wait", handle)
    return from_acc(o_acc, name, xp), lse_acc


def _backward_rank(do, q, k, v, o, lse, rank, world, causal, softmax_scale, backend):
    """One rank's ring backward given the global (o, lse) of its queries; returns (dq, dk, dv)."""
    xp = _xp(q)
    name = _dtype_name(q)
    acc = acc_dtype(name)
    s = q.shape[1]
    dq = xp.zeros(q.shape, dtype=acc)
    kb, vb = k, v
    h_dkv = None
    dk = dv = None
    for step in range(world):
        src = (rank - step) % world
        h_kv = (yield ("start", (kb, vb))) if step < world - 1 else None
        dk_b = xp.zeros(k.shape, dtype=acc)
        dv_b = xp.zeros(v.shape, dtype=acc)
        for qs, ks, cz in step_tasks(rank, src, world, s, causal):
            dq_t, dk_t, dv_t = flash_attn_backward(
                _cut(do, qs, xp), _cut(q, qs, xp), _cut(kb, ks, xp), _cut(vb, ks, xp), _cut(o, qs, xp),
                _cut_lse(lse, qs, xp), causal=cz, softmax_scale=softmax_scale, backend=backend)
            dq[:, qs] += to_acc(dq_t, xp)
            dk_b[:, ks] += to_acc(dk_t, xp)
            dv_b[:, ks] += to_acc(dv_t, xp)
        if h_dkv is not None:  # the block's partial sums from the ranks it visited before
            dk_in, dv_in = yield ("wait", h_dkv)
            dk_b += dk_in
            dv_b += dv_in
        if world > 1:  # on to the next rank (after the last step: home to the owner)
            h_dkv = yield ("start", (dk_b, dv_b))
        else:
            dk, dv = dk_b, dv_b
        if h_kv is not None:
            kb, vb = yield ("wait", h_kv)
    if world > 1:
        dk, dv = yield ("wait", h_dkv)
    return from_acc(dq, name, xp), from_acc(dk, name, xp), from_acc(dv, name, xp)


# ------------------------------------------------------------------------------------------------
# drivers
# ------------------------------------------------------------------------------------------------

class _Ready:
    """A completed transfer."""

    def __init__(self, arrays):
        self.arrays = arrays

    def wait(self):
        return self.arrays


def _drive_one(gen, comm):
    """Run one rank's generator against a real comm object."""
    rank, world = comm.rank, comm.world
    dst, src = (rank + 1) % world, (rank - 1) % world
    reply = None
    while True:
        try:
            op, arg = gen.send(reply)
        except StopIteration as e:
            return e.value
        if op == "start":
            if hasattr(comm, "start_sendrecv"):
                reply = comm.start_sendrecv(list(arg), dst, src)
            else:
                reply = _Ready(comm.sendrecv(list(arg), dst, src))
        else:
            reply = arg.wait()


class SimulatedRing:
    """An in-process ring of `world` ranks: `sendrecv_all(payloads)` gives rank r what rank r-1 sent
    (list rotation; arrays are copied, as a transfer would). `skip_comm=True` gives every rank its
    own payload back instead: the same schedule with no data moved (wrong results; for timing the
    compute alone)."""

    def __init__(self, world: int, *, skip_comm: bool = False):
        _check_world(0, world)
        self.world = world
        self.skip_comm = skip_comm

    def sendrecv_all(self, payloads):
        if len(payloads) != self.world:
            raise ValueError(f"SimulatedRing: {len(payloads)} payloads for world {self.world}")
        if self.skip_comm:
            return [list(p) for p in payloads]
        return [[_copy(a, _xp(a)) for a in payloads[(r - 1) % self.world]] for r in range(self.world)]


def _drive_lockstep(gens, ring: SimulatedRing):
    """Run every rank's generator in lockstep: each round, every rank makes the same request."""
    world = len(gens)
    replies = [None] * world
    results = [None] * world
    while True:
        reqs = []
        for r, g in enumerate(gens):
            try:
                reqs.append(g.send(replies[r]))
            except StopIteration as e:
                results[r] = e.value
                reqs.append(None)
        if all(x is None for x in reqs):
            return results
        if any(x is None for x in reqs) or len({x[0] for x in reqs}) != 1:
            raise RuntimeError("simulated ring: ranks out of step")
        if reqs[0][0] == "start":
            replies = [_Ready(x) for x in ring.sendrecv_all([list(x[1]) for x in reqs])]
        else:
            replies = [x[1].wait() for x in reqs]


def _check_all(shard_lists, names, causal):
    world = len(shard_lists[0])
    if world == 0:
        raise ValueError("simulated ring: no shards")
    for n, lst in zip(names, shard_lists):
        if len(lst) != world:
            raise ValueError(f"simulated ring: {len(lst)} {n} shards, {world} q shards")
        for x in lst:
            if not (_interop.is_numpy(x) or _interop.is_cupy(x)):
                raise TypeError(f"simulated ring: {n} shards must be NumPy or CuPy arrays, got {type(x).__name__}")
        if len({tuple(x.shape) for x in lst}) != 1:
            raise ValueError(f"simulated ring: the {n} shards differ in shape")
    return world


def simulate_ring_forward(q_shards, k_shards, v_shards, *, causal=False, softmax_scale=None, backend="auto",
                          ring: SimulatedRing | None = None):
    """All ranks' ring forward in one process: returns ([o_r], [lse_r]), rank by rank."""
    causal = _checks.check_flag("causal", causal)
    world = _check_all([q_shards, k_shards, v_shards], ["q", "k", "v"], causal)
    for r in range(world):
        _check_shards(q_shards[r], k_shards[r], v_shards[r], causal)
    ring = ring if ring is not None else SimulatedRing(world)
    gens = [_forward_rank(q_shards[r], k_shards[r], v_shards[r], r, world, causal, softmax_scale, backend)
            for r in range(world)]
    res = _drive_lockstep(gens, ring)
    return [x[0] for x in res], [x[1] for x in res]


def simulate_ring_backward(do_shards, q_shards, k_shards, v_shards, o_shards, lse_shards, *, causal=False,
                           softmax_scale=None, backend="auto", ring: SimulatedRing | None = None):
    """All ranks' ring backward in one process: returns ([dq_r], [dk_r], [dv_r])."""
    causal = _checks.check_flag("causal", causal)
    world = _check_all([q_shards, k_shards, v_shards, do_shards, o_shards, lse_shards],
                       ["q", "k", "v", "dout", "o", "lse"], causal)
    for r in range(world):
        _check_backward_extra(do_shards[r], q_shards[r], k_shards[r], v_shards[r], o_shards[r], lse_shards[r],
                              causal)
    ring = ring if ring is not None else SimulatedRing(world)
    gens = [_backward_rank(do_shards[r], q_shards[r], k_shards[r], v_shards[r], o_shards[r], lse_shards[r], r,
                           world, causal, softmax_scale, backend) for r in range(world)]
    res = _drive_lockstep(gens, ring)
    return [x[0] for x in res], [x[1] for x in res], [x[2] for x in res]


def _check_backward_extra(do, q, k, v, o, lse, causal):
    name = _check_shards(q, k, v, causal)
    for n, x in (("dout", do), ("o", o)):
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"ring attention: {n} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
        if _dtype_name(x) != name:
            raise TypeError(f"ring attention: {n} has dtype {_dtype_name(x)}, q has {name}")
    b, s, h, _ = q.shape
    if tuple(lse.shape) != (b, h, s):
        raise ValueError(f"ring attention: lse must have shape {(b, h, s)}, got {tuple(lse.shape)}")
    if _dtype_name(lse) != acc_dtype(name):
        raise TypeError(f"ring attention: lse must be {acc_dtype(name)}, got {_dtype_name(lse)}")


# ------------------------------------------------------------------------------------------------
# public per-rank entry points
# ------------------------------------------------------------------------------------------------

def ring_attention_forward(q, k, v, comm, *, causal=False, softmax_scale=None, backend="auto"):
    """This rank's ring attention forward: (o, lse) of the local queries over the whole sequence.

    q, k, v: this rank's shards (zig-zag shards when causal, see `zigzag_shard`); comm: the ring
    (`NcclRing`, or any object with rank, world and sendrecv)."""
    causal = _checks.check_flag("causal", causal)
    _check_world(comm.rank, comm.world)
    _check_shards(q, k, v, causal)
    return _drive_one(_forward_rank(q, k, v, comm.rank, comm.world, causal, softmax_scale, backend), comm)


def ring_attention_backward(do, q, k, v, o, lse, comm, *, causal=False, softmax_scale=None, backend="auto"):
    """This rank's ring attention backward: (dq, dk, dv) of its shards, given the (o, lse) that
    ring_attention_forward returned here and dout = dL/do of the local rows."""
    causal = _checks.check_flag("causal", causal)
    _check_world(comm.rank, comm.world)
    _check_backward_extra(do, q, k, v, o, lse, causal)
    return _drive_one(_backward_rank(do, q, k, v, o, lse, comm.rank, comm.world, causal, softmax_scale, backend),
                      comm)


def ring_attention(q, k, v, comm, *, causal=False, softmax_scale=None, backend="auto"):
    """ring_attention_forward's o alone."""
    return ring_attention_forward(q, k, v, comm, causal=causal, softmax_scale=softmax_scale, backend=backend)[0]


# ------------------------------------------------------------------------------------------------
# NCCL
# ------------------------------------------------------------------------------------------------

class _NcclHandle:
    def __init__(self, sends, recvs, done):
        self._sends = sends  # kept alive until the transfer is waited for
        self._recvs = recvs
        self._done = done

    def wait(self):
        import cupy

        cupy.cuda.get_current_stream().wait_event(self._done)
        self._sends = None
        return self._recvs


class NcclRing:
    """A ring over a cupy.cuda.nccl.NcclCommunicator: rank, world, sendrecv and start_sendrecv.

    Transfers run on `stream` (a new non-blocking stream when None): start_sendrecv records an event
    on the current (compute) stream, makes the communication stream wait for it, posts the sends and
    receives as one NCCL group (raw bytes, NCCL_UINT8, so every dtype including bfloat16 travels),
    and records a completion event; the handle's wait() makes the current stream wait for that
    event. Receive buffers come from CuPy's pool on the compute stream before the first event, and the
    sent arrays stay referenced until wait(), so stream-ordered pool reuse is safe.
    The launcher must set NCCL_NVLS_ENABLE=0 before NCCL initializes (NVLink multicast off)."""

    def __init__(self, nccl_comm, rank: int, world: int, stream=None):
        import cupy

        _check_world(rank, world)
        self.comm = nccl_comm
        self.rank = rank
        self.world = world
        self.stream = stream if stream is not None else cupy.cuda.Stream(non_blocking=True)

    def start_sendrecv(self, send_arrays, dst: int, src: int):
        import cupy
        from cupy.cuda import nccl

        compute = cupy.cuda.get_current_stream()
        sends = [_contig(a, cupy) for a in send_arrays]
        recvs = [cupy.empty(a.shape, dtype=cupy.uint8 if a.itemsize == 1 else
                            {2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[a.itemsize]).view(a.dtype)
                 for a in sends]
        ready = compute.record()
        self.stream.wait_event(ready)
        nccl.groupStart()
        try:
            for s, r in zip(sends, recvs):
                self.comm.send(s.data.ptr, s.nbytes, nccl.NCCL_UINT8, dst, self.stream.ptr)
                self.comm.recv(r.data.ptr, r.nbytes, nccl.NCCL_UINT8, src, self.stream.ptr)
        finally:
            nccl.groupEnd()
        done = self.stream.record()
        return _NcclHandle(sends, recvs, done)

    def sendrecv(self, send_arrays, dst: int, src: int):
        return self.start_sendrecv(send_arrays, dst, src).wait()
