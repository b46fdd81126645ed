"""Tiled FlashAttention on the CPU: the kernels' algorithm, written with NumPy.

This is the executable specification of kernels_cu/flash_fwd.cu and flash_bwd.cu: the same tiles
(block_m query rows x block_n key rows), the same online softmax in exp2 units, the same skipping of
tiles above the causal diagonal, the same backward (preprocess, one pass over key blocks that adds dQ's
share into an accumulator in key-block order, postprocess), and the same numbered step comments. What a CUDA thread block does for one
(m_block, head, batch) is done here for one m_block and every (batch, head) at once: arrays are
grouped as (batch, nheads_k, group, seqlen, head_dim) so that a query head and its kv head meet by
broadcasting, never by copying K or V per query head. Only tiles are looped over, and no more than
one block_m x block_n tile of scores per (batch, head) exists at a time.

Accumulation is in float64 for float64 inputs and float32 for float32 / float16 / bfloat16 inputs
(acc_t in kernels_cu/common.cuh). Tiles are sliced to the sequence, so the last tile of a sequence
is simply shorter; the mask rule is that of kernels_cu/mask.cuh.
"""

from __future__ import annotations

import math

import numpy as np

from .. import _mask, _philox

BLOCK_M = 64
BLOCK_N = 64
LOG2E = math.log2(math.e)


def available() -> tuple[bool, str]:
    return True, ""


def _acc_dtype(dtype) -> type:
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _Variants:
    """What a call's variants need per tile: the window, the score transform (softmax_scale, softcap,
    ALiBi, applied in natural units before the mask) and the dropout keep mask."""

    def __init__(self, batch, nheads, nheads_k, seqlen_q, seqlen_k, acc, softmax_scale, causal, window, softcap,
                 alibi_slopes, dropout_p, seed, offset, batch_index):
        self.seqlen_q, self.seqlen_k, self.acc = seqlen_q, seqlen_k, acc
        self.left, self.right = _mask.effective_window(causal, window)
        self.scale = softmax_scale
        self.softcap = float(softcap or 0.0)
        group = nheads // nheads_k
        self.slopes = None
        if alibi_slopes is not None:
            sl = np.asarray(alibi_slopes, dtype=acc)
            self.slopes = sl.reshape(sl.shape[0] if sl.ndim == 2 else 1, nheads_k, group)
        # softcap or ALiBi: scores are transformed to natural-unit logits (softmax_scale folded in)
        self.transform = bool(self.softcap) or self.slopes is not None
        self.dropout_p, self.seed, self.offset = float(dropout_p or 0.0), seed, offset
        self.bh = (np.arange(batch * nheads, dtype=np.int64) + batch_index * nheads).reshape(batch, nheads_k, group)

    def blocks_n(self, m_block, block_m, block_n):
        return _mask.n_block_range(m_block, block_m, block_n, self.seqlen_q, self.seqlen_k, self.left, self.right)

    def blocks_m(self, n_block, block_m, block_n):
        return _mask.m_block_range(n_block, block_m, block_n, self.seqlen_q, self.seqlen_k, self.left, self.right)

    def scores(self, acc_s, m0, m1, n0, n1, block_n):
        """(masked scores, 1 - tanh^2 of the softcap or None) of one tile, rows [m0, m1), cols [n0, n1)."""
        rows, cols = np.arange(m0, m1), np.arange(n0, n1)
        dcap = None
        if self.transform:
            acc_s = acc_s * self.acc(self.scale)
            if self.softcap:
                acc_s, t = _mask.apply_softcap(acc_s, self.softcap)
                dcap = _mask.softcap_grad(t)
            if self.slopes is not None:
                acc_s = acc_s + _mask.alibi_bias(self.slopes, rows, cols, self.seqlen_q, self.seqlen_k)
        if _mask.block_needs_mask(m0, m1, n0, n0 + block_n, self.seqlen_q, self.seqlen_k, self.left, self.right):
            acc_s = np.where(_mask.visible(rows, cols, self.seqlen_q, self.seqlen_k, self.left, self.right),
                             acc_s, -np.inf)
        return acc_s, dcap

    def dropped(self, x, m0, m1, n0, n1):
        """x * keep / (1 - dropout_p) on one tile (x itself without dropout)."""
        if not self.dropout_p:
            return x
        keep = _philox.keep(self.dropout_p, self.seed, self.offset, self.bh, np.arange(m0, m1), np.arange(n0, n1))
        return np.where(keep, x * self.acc(1.0 / (1.0 - self.dropout_p)), self.acc(0))


# --- layout ------------------------------------------------------------------------------------------


def _grouped(x, nheads_k: int, acc) -> np.ndarray:
    """(B, S, H, D), any strides -> contiguous (B, Hk, H // Hk, S, D) in the accumulator dtype.

    Query head h = hk * G + g uses kv head hk = h // G (the contract's GQA rule); k and v get G = 1.
    """
    b, s, h, d = x.shape
    x = np.ascontiguousarray(x.transpose(0, 2, 1, 3), dtype=acc)
    return x.reshape(b, nheads_k, h // nheads_k, s, d)


def _bshd(x, dtype) -> np.ndarray:
    """(B, Hk, G, S, D) -> contiguous (B, S, Hk * G, D) in dtype."""
    b, hk, g, s, d = x.shape
    return x.reshape(b, hk * g, s, d).transpose(0, 2, 1, 3).astype(dtype, order="C")


def _setup(q, k, v, softmax_scale):
    """What forward and backward share: the accumulator dtype, the scale (and in log2 units), and
    q, k, v grouped by kv head as (B, Hk, G, S, D) in that dtype (k, v with G = 1)."""
    acc = _acc_dtype(q.dtype)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    nheads_k = k.shape[2]
    return (acc, softmax_scale, softmax_scale * LOG2E,
            _grouped(q, nheads_k, acc), _grouped(k, nheads_k, acc), _grouped(v, nheads_k, acc))


# --- forward -----------------------------------------------------------------------------------------


def forward(q, k, v, *, causal=False, softmax_scale=None, out=None, lse=None, block_m=BLOCK_M, block_n=BLOCK_N,
            window=_mask.NO_WINDOW, softcap=0.0, alibi_slopes=None,
            dropout_p=0.0, seed=0, offset=0, batch_index=0):
    """(o, lse): o like q (input dtype), lse (batch, nheads, seqlen_q) in the accumulator dtype.

    With `out` / `lse` given (any strides), the results are written there and those are returned.
    Variants (cuflash/_mask.py, cuflash/_philox.py): window, softcap, alibi_slopes, dropout_p with
    seed and offset; batch_index is the dropout batch index of q's first batch entry (varlen)."""
    lse_out = lse
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    acc, softmax_scale, scale_log2, qg, kg, vg = _setup(q, k, v, softmax_scale)
    var = _Variants(batch, nheads, k.shape[2], seqlen_q, seqlen_k, acc, softmax_scale, causal, window, softcap,
                    alibi_slopes, dropout_p, seed, offset, batch_index)
    lse_scale = softmax_scale
    if var.transform:  # the scores are logits already: exp2 of them times log2(e)
        scale_log2, lse_scale = LOG2E, 1.0
    o = np.empty(qg.shape, dtype=acc)
    lse = np.empty(qg.shape[:-1], dtype=acc)

    # [1] Block coordinates: m_block, head, batch; the mask gives the key blocks to visit
    for m_block in range(_ceil_div(seqlen_q, block_m)):
        m0, m1 = m_block * block_m, min((m_block + 1) * block_m, seqlen_q)
        # the window (and causal) skip the key blocks no row of this block sees
        n_block_min, n_block_max = var.blocks_n(m_block, block_m, block_n)

        # [2] Load the Q tile
        q_tile = qg[..., m0:m1, :]
        row_max = np.full(q_tile.shape[:-1] + (1,), -np.inf, dtype=acc)
        row_sum = np.zeros(q_tile.shape[:-1] + (1,), dtype=acc)
        acc_o = np.zeros(q_tile.shape, dtype=acc)

        # Last key block first, as flash_fwd.cu does: the tiles that need masking come first.
        for n_block in range(n_block_max - 1, n_block_min - 1, -1):
            n0, n1 = n_block * block_n, min((n_block + 1) * block_n, seqlen_k)
            k_tile, v_tile = kg[..., n0:n1, :], vg[..., n0:n1, :]

            # [3] S = Q K^T
            acc_s = q_tile @ k_tile.swapaxes(-1, -2)  # (B, Hk, G, bm, bn)

            # [4] Score modifiers (softcap, ALiBi); mask the sequence tail, the causal diagonal and the window
            acc_s, _ = var.scores(acc_s, m0, m1, n0, n1, block_n)

            # [5] Online softmax: update row_max, rescale acc_o and row_sum, P = exp2(S * scale_log2 - row_max * scale_log2)
            row_max_new = np.maximum(row_max, acc_s.max(axis=-1, keepdims=True))
            # A row that has seen no visible key keeps row_max = -inf: subtract 0 so that exp2
            # gives 0 instead of exp2(-inf + inf) = NaN.
            max_scaled = np.where(row_max_new == -np.inf, 0.0, row_max_new * scale_log2).astype(acc)
            rescale = np.exp2(row_max * scale_log2 - max_scaled)
            p = np.exp2(acc_s * scale_log2 - max_scaled)
            row_sum = row_sum * rescale + p.sum(axis=-1, keepdims=True)
            acc_o *= rescale
            row_max = row_max_new

            # [6] O += dropout(P) V
            # (dropped from P here only: row_sum, and so the LSE, are those of the undropped P)
            acc_o += var.dropped(p, m0, m1, n0, n1) @ v_tile

        # [7] Finalize: O /= row_sum, LSE = row_max * softmax_scale + log(row_sum); rows that saw no key give O = 0, LSE = -inf
        seen = row_sum > 0
        row_sum_safe = np.where(seen, row_sum, 1.0).astype(acc)
        o_tile = acc_o / row_sum_safe  # acc_o is 0 where no key was seen
        lse_tile = np.where(seen, row_max * lse_scale + np.log(row_sum_safe), -np.inf)

        # [8] Store O and LSE
        o[..., m0:m1, :] = o_tile
        lse[..., m0:m1] = lse_tile[..., 0]

    return _store(_bshd(o, q.dtype), out), _store(lse.reshape(batch, nheads, seqlen_q), lse_out)


# --- backward ----------------------------------------------------------------------------------------


def backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, deterministic=False,
             dq=None, dk=None, dv=None, workspace=None, block_m=BLOCK_M, block_n=BLOCK_N,
             window=_mask.NO_WINDOW, softcap=0.0, alibi_slopes=None,
            dropout_p=0.0, seed=0, offset=0, batch_index=0):
    """(dq, dk, dv) in the input dtype, bshd contiguous, or written into the given dq / dk / dv.
    Always deterministic: dQ's shares are added in key-block order, as flash_bwd.cu's DETERMINISTIC
    mode does. workspace is not used: D and the dQ accumulator live here in the grouped layout. The variant arguments are forward's; dropout
    regenerates the forward's mask."""
    dq_out, dk_out, dv_out = dq, dk, dv
    del deterministic, workspace
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    acc, softmax_scale, scale_log2, qg, kg, vg = _setup(q, k, v, softmax_scale)
    var = _Variants(batch, nheads, nheads_k, seqlen_q, seqlen_k, acc, softmax_scale, causal, window, softcap,
                    alibi_slopes, dropout_p, seed, offset, batch_index)
    if var.transform:
        scale_log2 = LOG2E
    dog = _grouped(do, nheads_k, acc)
    og = _grouped(o, nheads_k, acc)
    lse = np.asarray(lse, dtype=acc).reshape(batch, nheads_k, group, seqlen_q)
    # LSE in log2 units. A row that saw no key has LSE = -inf: use +inf so that its P comes out
    # exp2(S * scale_log2 - inf) = 0 rather than exp2(+inf).
    lse_log2 = np.where(lse == -np.inf, np.inf, lse * LOG2E).astype(acc)

    # [1] Preprocess: D = rowsum(dO * O); zero the dQ accumulator and semaphores
    # (no semaphores here: the loop below runs the key blocks in order)
    dsum = np.sum(dog * og, axis=-1)  # (B, Hk, G, Sq)
    dq_accum = np.zeros(qg.shape, dtype=acc)

    dk = np.empty(kg.shape, dtype=acc)
    dv = np.empty(vg.shape, dtype=acc)

    # [2] Block coordinates: n_block, kv head, batch; the mask gives the query blocks to visit
    for n_block in range(_ceil_div(seqlen_k, block_n)):
        n0, n1 = n_block * block_n, min((n_block + 1) * block_n, seqlen_k)
        k_tile, v_tile = kg[..., n0:n1, :], vg[..., n0:n1, :]  # (B, Hk, 1, bn, D)
        acc_dk = np.zeros((batch, nheads_k, n1 - n0, head_dim), dtype=acc)
        acc_dv = np.zeros_like(acc_dk)

        # the window (and causal) skip the query blocks that see no column of this block
        for m_block in range(*var.blocks_m(n_block, block_m, block_n)):
            m0, m1 = m_block * block_m, min((m_block + 1) * block_m, seqlen_q)

            # [3] Load the Q, dO tiles and LSE, D rows of one query block
            q_tile, do_tile = qg[..., m0:m1, :], dog[..., m0:m1, :]  # (B, Hk, G, bm, D)
            lse_rows = lse_log2[..., m0:m1, None]
            d_rows = dsum[..., m0:m1, None]

            # [4] Recompute S = Q K^T, score modifiers, mask, P = exp2(S * scale_log2 - LSE * log2(e))
            acc_s = q_tile @ k_tile.swapaxes(-1, -2)
            acc_s, dcap = var.scores(acc_s, m0, m1, n0, n1, block_n)
            p = np.exp2(acc_s * scale_log2 - lse_rows)

            # [5] dV += P^T dO
            # The sum over axis 2 is the kernel's loop over the kv head's group of query heads.
            # Dropout: the dropped P, regenerated from the same counters as the forward's.
            acc_dv += (var.dropped(p, m0, m1, n0, n1).swapaxes(-1, -2) @ do_tile).sum(axis=2)

            # [6] dP = dO V^T
            # Dropout: dL/dP is dO V^T times keep / (1 - p); D = rowsum(dO * O) holds with the dropped O.
            dp = var.dropped(do_tile @ v_tile.swapaxes(-1, -2), m0, m1, n0, n1)

            # [7] dS = P * (dP - D)
            # A softcap multiplies by its derivative 1 - tanh^2.
            ds = p * (dp - d_rows)
            if dcap is not None:
                ds *= dcap

            # [8] dK += dS^T Q
            acc_dk += (ds.swapaxes(-1, -2) @ q_tile).sum(axis=2)

            # [9] dQ_accum += dS K: fp32 atomic adds, in key-block order when deterministic
            # (in acc: float64 for float64; key blocks in increasing order, so always deterministic)
            dq_accum[..., m0:m1, :] += ds @ k_tile

        # [10] Store dK * softmax_scale and dV
        dk[:, :, 0, n0:n1, :] = acc_dk * softmax_scale
        dv[:, :, 0, n0:n1, :] = acc_dv

    # [11] Postprocess: dQ = dQ_accum * softmax_scale in the input dtype
    dq = dq_accum * softmax_scale
    return _store(_bshd(dq, q.dtype), dq_out), _store(_bshd(dk, k.dtype), dk_out), _store(_bshd(dv, v.dtype), dv_out)


# --- variable-length batches ----------------------------------------------------------------------------


def _sequences(cu_seqlens_q, cu_seqlens_k):
    cq, ck = (np.asarray(c).astype(np.int64).tolist() for c in (cu_seqlens_q, cu_seqlens_k))
    return [(i, cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def _slopes_of(alibi_slopes, i):
    if alibi_slopes is None or np.ndim(alibi_slopes) == 1:
        return alibi_slopes
    return alibi_slopes[i:i + 1]


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, out=None, lse=None,
                   alibi_slopes=None, **kwargs):
    """Packed (total, nheads, head_dim) q, k, v; sequence by sequence through `forward` (sequence i
    is dropout's batch index i; the longest lengths are not needed). Returns (o like q, lse (nheads,
    total_q) in the accumulator dtype)."""
    del max_seqlen_q, max_seqlen_k
    acc = _acc_dtype(q.dtype)
    o = np.zeros(q.shape, dtype=q.dtype) if out is None else out
    lse_all = np.full((q.shape[1], q.shape[0]), -np.inf, dtype=acc)
    if out is not None:
        o[...] = 0
    for i, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue
        oi, li = forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], alibi_slopes=_slopes_of(alibi_slopes, i),
                         batch_index=i, **kwargs)
        o[q0:q1] = oi[0]
        lse_all[:, q0:q1] = li[0]
    return o, _store(lse_all, lse)


def varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                    dq=None, dk=None, dv=None, alibi_slopes=None, **kwargs):
    """Gradients of varlen_forward, sequence by sequence through `backward`; lse (nheads, total_q)."""
    del max_seqlen_q, max_seqlen_k
    kwargs.pop("workspace", None)
    kwargs.pop("dsum", None)
    grads = [np.zeros(x.shape, dtype=x.dtype) if g is None else g for x, g in ((q, dq), (k, dk), (v, dv))]
    for g in grads:
        g[...] = 0
    for i, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 and k1 == k0:
            continue
        gi = backward(do[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], o[None, q0:q1],
                      np.asarray(lse)[None, :, q0:q1], alibi_slopes=_slopes_of(alibi_slopes, i), batch_index=i,
                      **kwargs)
        grads[0][q0:q1], grads[1][k0:k1], grads[2][k0:k1] = gi[0][0], gi[1][0], gi[2][0]
    return tuple(grads)


# --- KV cache --------------------------------------------------------------------------------------------


def _cache_keys(cache, i: int, n: int, block_table):
    """Key rows 0..n of entry i, (1, n, heads_k, head_dim): the dense cache's slab, or the entry's pages
    gathered (a page outside the pool reads as zeros, as in the kernels)."""
    if block_table is None:
        return cache[i:i + 1, :n]
    page_size, num_pages = cache.shape[1], cache.shape[0]
    pages = np.asarray(block_table[i, :_ceil_div(n, page_size)], dtype=np.int64)
    ok = (pages >= 0) & (pages < num_pages)
    rows = cache[np.where(ok, pages, 0)]
    rows[~ok] = 0
    return rows.reshape(1, -1, *cache.shape[2:])[:, :n]


def kvcache_forward(q, k_cache, v_cache, seqlens_k, block_table=None, *, out=None, lse=None, alibi_slopes=None,
                    num_splits=0, **kwargs):
    """Attention of q (batch, seqlen_q, nheads, head_dim) over a KV cache, entry by entry through
    `forward`: entry b sees its first seqlens_k[b] keys (clamped to the cache's capacity, a negative
    count as 0, as the kernels do). The cache is dense (batch, capacity, nheads_k, head_dim), or page
    pools (num_pages, page_size, nheads_k, head_dim) with block_table int32 (batch, max_pages).
    num_splits (the GPU's split-KV) does not apply: each entry is computed whole.
    Returns (o like q, lse (batch, nheads, seqlen_q) in the accumulator dtype)."""
    batch = q.shape[0]
    capacity = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    counts = np.clip(np.asarray(seqlens_k, dtype=np.int64), 0, capacity)
    o = np.empty(q.shape, dtype=q.dtype) if out is None else out
    lse_all = np.empty((batch, q.shape[2], q.shape[1]), dtype=_acc_dtype(q.dtype))
    for i in range(batch):
        n = int(counts[i])
        oi, li = forward(q[i:i + 1], _cache_keys(k_cache, i, n, block_table), _cache_keys(v_cache, i, n, block_table),
                         alibi_slopes=_slopes_of(alibi_slopes, i), batch_index=i, **kwargs)
        o[i], lse_all[i] = oi[0], li[0]
    return o, _store(lse_all, lse)


def _store(result, dest):
    """`result`, or `dest` after copying result into it."""
    if dest is None:
        return result
    dest[...] = result
    return dest
