"""CUDA provider for softcapped scores (Gemma 2's tanh capping): FlexAttention with the cap as its score_mod.

No cuDNN or FlashAttention kernel caps scores; FlexAttention compiles any score_mod into its Triton kernels and
returns the LSE, so a softcapped block runs on it inside the same region and LSE merge as every other block. One
compiled `flex_attention` per process (Inductor's flex kernels; a recompile per new block shape), the block's mask
as a BlockMask (a causal square top-left, a window on the bottom-right diagonal: base.AttentionKernel's contract),
cached per shape.

Backward from the FINAL out and lse (the executor's contract; flex's own backward knows only the block's): with
c = exp(lse_block - lse) per row, the block's share of the final attention's gradient is flex's backward of the
recomputed block with grad_out = c * dout and grad_lse = c * (dout . (out_block - out)): flex's row term
dout_b . out_b then becomes c * dout . out, the final one. One recomputed forward a block: the price of using
flex's backward unchanged.

`kernel="auto"` offers it only where nothing else runs the site (`last_resort`): softcapped sites on CUDA, and fp32
CUDA sites, which cuDNN and FA2 do not take.
"""

from __future__ import annotations

import contextlib
import threading
from functools import lru_cache

import torch

from ..precision import acc_dtype
from ._cuda import cuda_half_reason


def _window_mod(lq: int, lk: int, causal: bool, window: tuple[int, int] | None):
    """The block's mask_mod, or None for an unmasked block."""
    if window is not None:
        left, right = window
        shift = lk - lq  # windows sit on the bottom-right diagonal

        def windowed(b, h, q, kv):
            rel = kv - q - shift
            ok = rel == rel  # all True, shaped like rel
            if left >= 0:
                ok = ok & (rel >= -left)
            if right >= 0:
                ok = ok & (rel <= right)
            return ok

        return windowed
    if causal:
        return lambda b, h, q, kv: q >= kv  # a causal square (lq == lk): top-left is bottom-right
    return None


@lru_cache(maxsize=64)
def _block_mask(lq: int, lk: int, causal: bool, window: tuple[int, int] | None, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    mod = _window_mod(lq, lk, causal, window)
    return None if mod is None else create_block_mask(mod, None, None, lq, lk, device=device)


@lru_cache(maxsize=1)
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


def _flex(q: torch.Tensor):
    """Inductor's flex kernels on CUDA; elsewhere (CPU tests) flex's own eager math."""
    if q.is_cuda:
        return _compiled()
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def _compile_room(q: torch.Tensor):
    """Room for one compile per block shape and mask (a site's blocks have a few; Dynamo's default limit of 8
    recompiles would drop later shapes to flex's unfused math)."""
    return torch._dynamo.config.patch(recompile_limit=256) if q.is_cuda else contextlib.nullcontext()


def _run(q, k, v, causal, scale, window, softcap):
    """(out, lse (natural log)) of one block with capped scores."""

    def cap(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    from torch.nn.attention.flex_attention import AuxRequest

    mask = _block_mask(q.shape[-2], k.shape[-2], causal, window, str(q.device))
    with _compile_room(q):
        out, aux = _flex(q)(
            q, k, v, score_mod=cap if softcap else None, block_mask=mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1], return_aux=AuxRequest(lse=True),
        )  # fmt: skip
    return out, aux.lse


class FlexSoftcapKernel:
    name = "flex_softcap"
    supports_window = True
    supports_softcap = True
    last_resort = True
    """kernel="auto" offers it only where no other provider runs the site: softcapped scores on CUDA."""

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if dtype == torch.float32 and device.type == "cuda":  # flex takes fp32 too (cuDNN and FA2 do not)
            return None if torch.cuda.is_available() else "CUDA is not available in this process"
        return cuda_half_reason(device, dtype, "FlexAttention (softcap)")

    def supports_head_dim(self, head_dim: int, v_head_dim: int | None = None) -> str | None:
        dims = {head_dim, head_dim if v_head_dim is None else v_head_dim}
        if any(d < 16 or d > 256 or d & (d - 1) for d in dims):
            return f"FlexAttention (softcap) takes head dims that are powers of two in [16, 256], not {sorted(dims)}"
        return None

    def forward(self, q, k, v, causal, scale, window=None, softcap=0.0):
        return _in_clean_dispatch_state(_run, q, k, v, causal, scale, window, softcap)

    def backward(self, dout, q, k, v, out, lse, causal, scale, window=None, softcap=0.0):
        return _in_clean_dispatch_state(_backward, dout, q, k, v, out, lse, causal, scale, window, softcap)


def _in_clean_dispatch_state(fn, *args):
    """fn(*args) with the dispatcher's thread-local key sets of a fresh thread. Our regions are custom ops: their
    impls run with keys above the backend excluded (autograd, and under aot_autograd's aliasing-check mode on a
    compiled graph's first call the functorch keys too), where flex's vmapped score and mask mods fail ("NYI:
    querying is_contiguous inside of vmap"; Gemma 2 on the H200, torch 2.11) and its backward records no graph.
    On the calling thread, not a thread of its own: on CUDA the caller of backward is the autograd engine's device
    thread, and another thread's autograd.grad queues onto it and waits forever (the H200, 2026-12-02)."""
    include, exclude = _fresh_thread_key_sets()
    with torch._C._ForceDispatchKeyGuard(include, exclude):
        return fn(*args)


@lru_cache(maxsize=1)
def _fresh_thread_key_sets() -> tuple[torch._C.DispatchKeySet, torch._C.DispatchKeySet]:
    """The thread-local include and exclude key sets a new thread starts with."""
    sets = []

    def read() -> None:
        sets.append((torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()))

    reader = threading.Thread(target=read)
    reader.start()
    reader.join()
    return sets[0]


def _backward(dout, q, k, v, out, lse, causal, scale, window, softcap):
    """dq, dk, dv of one block from the final (merged) out and lse, through flex's own backward."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out_b, lse_b = _run(*leaves, causal, scale, window, softcap)
        acc = acc_dtype(q.dtype)
        c = torch.exp(lse_b.detach().to(acc) - lse.to(acc))  # this block's weight in the final rows
        d = dout.to(acc)
        grad_out = (d * c.unsqueeze(-1)).to(out_b.dtype)
        grad_lse = c * (d * (out_b.detach().to(acc) - out.to(acc))).sum(-1)
        dq, dk, dv = torch.autograd.grad((out_b, lse_b), leaves, (grad_out, grad_lse.to(lse_b.dtype)))
    return dq, dk, dv
