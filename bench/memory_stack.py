"""The model the memory benchmark trains: N Llama3-8B-shaped blocks (RMSNorm, q/k/v/o projections, causal GQA
SDPA, optionally the SwiGLU MLP), each block compiled on its own (as torchtitan does), optionally wrapped in
per-block activation checkpointing, and the per-token byte counts the benchmark's targets are built from.

RoPE is left out: it is token-local, costs no collective and at most one q- and one k-sized tensor a layer.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int = 4096
    hq: int = 32
    hkv: int = 8
    head_dim: int = 128
    ffn: int = 14336


LLAMA3_8B = Shape()
TINY = Shape(hidden=64, hq=4, hkv=2, head_dim=16, ffn=128)  # CPU smoke test


class Block(nn.Module):
    """One pre-norm transformer block; the MLP only when `mlp`."""

    def __init__(self, shape: Shape, mlp: bool) -> None:
        super().__init__()
        h, d = shape.hidden, shape.head_dim
        self.shape, self.mlp = shape, mlp
        self.norm = nn.RMSNorm(h)
        self.wq = nn.Linear(h, shape.hq * d, bias=False)
        self.wk = nn.Linear(h, shape.hkv * d, bias=False)
        self.wv = nn.Linear(h, shape.hkv * d, bias=False)
        self.wo = nn.Linear(shape.hq * d, h, bias=False)
        if mlp:
            self.norm2 = nn.RMSNorm(h)
            self.w1 = nn.Linear(h, shape.ffn, bias=False)
            self.w3 = nn.Linear(h, shape.ffn, bias=False)
            self.w2 = nn.Linear(shape.ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        sh = self.shape
        n = self.norm(x)
        q = self.wq(n).view(b, s, sh.hq, sh.head_dim).transpose(1, 2)
        k = self.wk(n).view(b, s, sh.hkv, sh.head_dim).transpose(1, 2)
        v = self.wv(n).view(b, s, sh.hkv, sh.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=sh.hq != sh.hkv)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, sh.hq * sh.head_dim))
        if self.mlp:
            m = self.norm2(x)
            x = x + self.w2(F.silu(self.w1(m)) * self.w3(m))
        return x


def _plain(block: Block, x: torch.Tensor) -> torch.Tensor:
    return block(x)


def _checkpointed(block: Block, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(block, x, use_reentrant=False)


def build(shape: Shape, layers: int, mlp: bool, device: str, dtype: torch.dtype) -> nn.ModuleList:
    """The blocks, weights in `dtype`, small random values (the fake group moves no data: values do not matter)."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(shape, mlp) for _ in range(layers)).to(device=device, dtype=dtype)
    for p in blocks.parameters():
        p.grad = torch.zeros_like(p)  # grads exist before the measured step: the peak is activations + static
    return blocks


def compiled_step(blocks: nn.ModuleList, backend, checkpointed: bool):
    """fwd+bwd of the stack, every block through one compiled function (same code, a different module each call:
    Dynamo compiles it once and reuses it for every layer)."""
    fn = torch.compile(_checkpointed if checkpointed else _plain, backend=backend, fullgraph=True, dynamic=False)

    def step(x: torch.Tensor, dout: torch.Tensor) -> None:
        for block in blocks:
            x = fn(block, x)
        x.backward(dout)

    return step


def param_bytes(shape: Shape, mlp: bool) -> int:
    """One block's weight bytes in bf16."""
    h, d = shape.hidden, shape.head_dim
    n = 2 * h + h * (shape.hq + 2 * shape.hkv) * d + shape.hq * d * h
    n += 3 * h * shape.ffn if mlp else 0
    return 2 * n


def saved_bytes_per_token(shape: Shape, mlp: bool, checkpointed: bool) -> int:
    """Rough bf16 bytes a block keeps for backward per token (to skip single-GPU baselines that cannot fit):
    input, normed input, q, k, v, attention output; the MLP's input, normed input, gate, up, product."""
    if checkpointed:
        return 2 * shape.hidden
    h, d = shape.hidden, shape.head_dim
    n = 2 * h + 2 * shape.hq * d + 2 * shape.hkv * d
    n += 2 * h + 3 * shape.ffn if mlp else 0
    return 2 * n


def kv_bytes_per_token(shape: Shape) -> int:
    """K and V of one token in bf16 (what the ring shifts and the all-gather gathers)."""
    return 2 * 2 * shape.hkv * shape.head_dim


def block_transient_per_token(shape: Shape, mlp: bool) -> int:
    """Rough bf16 bytes one block's forward (recomputed under checkpointing) holds per token at its peak."""
    return saved_bytes_per_token(shape, mlp, checkpointed=False) + 2 * 2 * shape.hidden
