"""Differentiable cuflash for torch: `flash_attn_func` and `flash_attn_varlen_func`.

Each is a pair of torch custom ops (torch.library.custom_op), forward and backward, joined by
register_autograd: the forward saves (q, k, v, o, lse) and the backward calls cuflash's manual
backward, which recomputes P. An op is opaque to torch.compile, so a model that uses it traces with
no graph break (fullgraph=True), and register_fake gives the compiler the results' shapes, dtypes
and strides without running a kernel. The ops call cuflash's public functions on the tensors
themselves: on the GPU the results come from torch's caching allocator and the kernels run on
torch's current stream (a cached call is CUDA-graph safe, see _plan.py); CPU tensors run on the
NumPy backend where there is no GPU (backend="auto").

torch is imported here, and nowhere in cuflash's core: `import cuflash.torch` is the opt-in.
"""

from typing import Optional

import torch
from torch import Tensor

from . import _checks, api

# A variant argument at its default is not passed on at all: cuflash's plan cache needs the dropout arguments
# to be the API's own default objects (api._plannable_variants); a window and a softcap it keys by value.
_NO_WINDOW = (-1, -1)


def _variants(window_left, window_right, softcap, alibi_slopes, dropout_p, seed, offset) -> dict:
    kw = {}
    if (window_left, window_right) != _NO_WINDOW:
        kw["window"] = (window_left, window_right)
    if softcap != 0.0:
        kw["softcap"] = softcap
    if alibi_slopes is not None:
        kw["alibi_slopes"] = alibi_slopes
    if dropout_p != 0.0:
        kw.update(dropout_p=dropout_p, seed=seed, offset=offset)
    return kw


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# --- dense ---------------------------------------------------------------------------------------


@torch.library.custom_op("cuflash::forward", mutates_args=())
def _forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: Optional[float], window_left: int,
             window_right: int, softcap: float, alibi_slopes: Optional[Tensor], dropout_p: float, seed: int,
             offset: int, backend: str, deterministic: bool) -> tuple[Tensor, Tensor]:
    del deterministic  # the backward's (carried through ctx)
    return api.flash_attn_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, backend=backend,
                                  **_variants(window_left, window_right, softcap, alibi_slopes, dropout_p, seed,
                                              offset))


@_forward.register_fake
def _(q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, offset,
      backend, deterministic):
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=_lse_dtype(q))


@torch.library.custom_op("cuflash::backward", mutates_args=())
def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
              softmax_scale: Optional[float], window_left: int, window_right: int, softcap: float,
              alibi_slopes: Optional[Tensor], dropout_p: float, seed: int, offset: int,
              backend: str, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    return api.flash_attn_backward(dout, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale,
                                   backend=backend, deterministic=deterministic,
                                   **_variants(window_left, window_right, softcap, alibi_slopes, dropout_p, seed,
                                               offset))


@_backward.register_fake
def _(dout, q, k, v, o, lse, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
      seed, offset, backend, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *args = inputs
    o, lse = output
    alibi_slopes = args[5]
    ctx.save_for_backward(q, k, v, o, lse, alibi_slopes)
    ctx.args = args[:5] + args[6:]  # causal .. softcap, dropout_p .. deterministic
    # no gradient flows back through lse: a loss of lse alone raises, and lse's share of a loss that also uses o
    # is dropped (README: lse is not differentiable)
    ctx.mark_non_differentiable(lse)


def _grads(ctx, dout, dlse):
    q, k, v, o, lse, alibi_slopes = ctx.saved_tensors
    causal, scale, wl, wr, softcap, dropout_p, seed, offset, backend, deterministic = ctx.args
    dq, dk, dv = _backward(dout, q, k, v, o, lse, causal, scale, wl, wr, softcap, alibi_slopes, dropout_p, seed,
                           offset, backend, deterministic)
    return dq, dk, dv, *([None] * 11)


_forward.register_autograd(_grads, setup_context=_setup_context)


# --- variable-length batches ---------------------------------------------------------------------


@torch.library.custom_op("cuflash::varlen_forward", mutates_args=())
def _varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                    max_seqlen_k: int, causal: bool, softmax_scale: Optional[float], window_left: int,
                    window_right: int, softcap: float, alibi_slopes: Optional[Tensor], dropout_p: float, seed: int,
                    offset: int, backend: str, deterministic: bool) -> tuple[Tensor, Tensor]:
    del deterministic  # the backward's (carried through ctx)
    return api.flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         causal=causal, softmax_scale=softmax_scale, backend=backend,
                                         **_variants(window_left, window_right, softcap, alibi_slopes, dropout_p,
                                                     seed, offset))


@_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left,
      window_right, softcap, alibi_slopes, dropout_p, seed, offset, backend, deterministic):
    total, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((h, total), dtype=_lse_dtype(q))


@torch.library.custom_op("cuflash::varlen_backward", mutates_args=())
def _varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                     softmax_scale: Optional[float], window_left: int, window_right: int, softcap: float,
                     alibi_slopes: Optional[Tensor], dropout_p: float, seed: int, offset: int,
                     backend: str, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    return api.flash_attn_varlen_backward(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, causal=causal, softmax_scale=softmax_scale, backend=backend,
                                          deterministic=deterministic,
                                          **_variants(window_left, window_right, softcap, alibi_slopes, dropout_p,
                                                      seed, offset))


@_varlen_backward.register_fake
def _(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      window_left, window_right, softcap, alibi_slopes, dropout_p, seed, offset, backend, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *args = inputs
    o, lse = output
    alibi_slopes = args[7]
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, alibi_slopes)
    ctx.args = args[:7] + args[8:]  # max_seqlen_q .. softcap, dropout_p .. deterministic
    ctx.mark_non_differentiable(lse)


def _varlen_grads(ctx, dout, dlse):
    q, k, v, o, lse, cu_q, cu_k, alibi_slopes = ctx.saved_tensors
    max_q, max_k, causal, scale, wl, wr, softcap, dropout_p, seed, offset, backend, deterministic = ctx.args
    dq, dk, dv = _varlen_backward(dout, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap,
                                  alibi_slopes, dropout_p, seed, offset, backend, deterministic)
    return dq, dk, dv, *([None] * 15)


_varlen_forward.register_autograd(_varlen_grads, setup_context=_varlen_setup_context)


# --- the public functions --------------------------------------------------------------------------


def _seed(dropout_p, seed) -> int:
    """seed=None with dropout draws one from torch's default generator (torch.manual_seed governs it);
    torch.compile cannot trace that draw, so there the caller passes the seed."""
    if seed is not None or dropout_p == 0.0:
        return 0 if seed is None else seed
    if torch.compiler.is_compiling():
        raise ValueError("cuflash.torch: under torch.compile, dropout needs an explicit seed= (and a new "
                         "seed or offset= each step)")
    return int(torch.randint(0, 2**63 - 1, ()).item())


def flash_attn_func(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                    dropout_p=0.0, seed=None, offset=0, return_lse=False, backend="auto", deterministic=False):
    """cuflash.flash_attn as a differentiable torch function: q (batch, seqlen_q, nheads, head_dim),
    k, v (batch, seqlen_k, nheads_k, head_dim); returns o like q, or (o, lse) with return_lse=True
    (lse (batch, nheads, seqlen_q), float32 (float64 for float64 inputs), not differentiable).

    The variant arguments are cuflash.flash_attn's, except that seed=None with dropout_p > 0 draws a
    seed from torch's generator (0 <= seed < 2**63 here: the op's int is 64-bit signed). Gradients
    flow to q, k and v; deterministic=True makes the backward's dq bitwise reproducible
    (cuflash.flash_attn_backward).
    """
    left, right = _checks.check_window(window)
    o, lse = _forward(q, k, v, causal, softmax_scale, left, right, softcap, alibi_slopes, dropout_p,
                      _seed(dropout_p, seed), offset, backend, _checks.check_flag("deterministic", deterministic))
    return (o, lse) if return_lse else o


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                           softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                           seed=None, offset=0, return_lse=False, backend="auto", deterministic=False):
    """cuflash.flash_attn_varlen as a differentiable torch function: packed q (total_q, nheads,
    head_dim), k, v (total_k, nheads_k, head_dim), int32 cu_seqlens; returns o, or (o, lse) with lse
    (nheads, total_q). Keywords as flash_attn_func."""
    left, right = _checks.check_window(window)
    o, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                             left, right, softcap, alibi_slopes, dropout_p, _seed(dropout_p, seed), offset, backend,
                             _checks.check_flag("deterministic", deterministic))
    return (o, lse) if return_lse else o


__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
