"""FlexAttention under CP: which global tokens a rank's q and key buffers hold, and the BlockMask rows that follow.

A flex region attends a q buffer (this rank's tokens under all_gather, every token for some heads under a2a)
against a key buffer (every token, in the order the collective delivers them: rank-major local orders). Both are
lists of a chunk layout's chunks. Two things follow from those lists, both pure index math:

- positions: the GLOBAL position of each buffer index, which the user's mask_mod / score_mod see (so a mask
  written for one GPU stays right). One run of chunks is an offset; anything else a lookup in a tiny table of
  chunk ids (`Positions`), evaluated inside the mods;
- block tables: the global BlockMask's rows for the buffer's q blocks and its kv block numbers renumbered into
  the key buffer's order (`derive_tables`), on device, without materialising a dense mask. Chunks must be whole
  blocks for this (the planner checks), so a block of the buffer is a block of the global mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import ChunkLayout


def rank_major_chunks(layout: ChunkLayout, cp: int) -> list[int]:
    """Global chunk ids, in order, of a buffer holding every rank's local tokens rank after rank (what an
    all-gather or a source-rank-major all-to-all delivers)."""
    return [c for p in range(cp) for c in layout.rank_chunks(p, cp)]


@dataclass(frozen=True)
class Positions:
    """Buffer index -> global position, for a buffer made of `chunks` (global chunk ids) of `chunk` tokens."""

    chunks: tuple[int, ...]
    chunk: int

    @property
    def identity(self) -> bool:
        return self.chunks == tuple(range(len(self.chunks)))

    @property
    def offset(self) -> int | None:
        """The constant shift when the chunks are one ascending run, else None (a table is needed)."""
        first = self.chunks[0]
        return first * self.chunk if self.chunks == tuple(range(first, first + len(self.chunks))) else None

    def table(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.chunks, dtype=torch.int32, device=device)

    def apply(self, idx: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
        """Global positions of buffer indices `idx` (inside a mod: `idx` is a scalar int tensor)."""
        if self.offset is not None:
            return idx + self.offset if self.offset else idx
        return table[idx // self.chunk] * self.chunk + idx % self.chunk

    @property
    def tokens(self) -> int:
        return len(self.chunks) * self.chunk

    def global_blocks(self, block: int, seq_len: int) -> list[int]:
        """The global block number of each `block`-sized block of the buffer: all of them in order when the buffer
        is the whole sequence in global order, else chunk by chunk (the planner checked chunks are whole blocks)."""
        if self.identity and self.tokens == seq_len:
            return list(range(-(-seq_len // block)))
        per_chunk = self.chunk // block
        return [c * per_chunk + i for c in self.chunks for i in range(per_chunk)]


def _dense(num: torch.Tensor, idx: torch.Tensor, cols: int) -> torch.Tensor:
    """(..., R) counts and (..., R, K) ordered indices -> (..., R, cols) int32 0/1 block map."""
    valid = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
    target = torch.where(valid, idx.long(), cols)
    dense = torch.zeros((*idx.shape[:-1], cols + 1), dtype=torch.int32, device=idx.device)
    return dense.scatter(-1, target, 1)[..., :cols]


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 0/1 block map -> (counts, indices): the listed blocks first, in ascending order (BlockMask's form)."""
    num = dense.sum(-1, dtype=torch.int32)
    idx = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return num, idx


def transpose_tables(num: torch.Tensor, idx: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' lists of column blocks -> columns' lists of row blocks (the q tables flex's backward reads)."""
    return _ordered(_dense(num, idx, cols).transpose(-1, -2))


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows `rows` of a table's row dim (the last dim of counts): a narrow when they are one ascending run."""
    dim = -2 if t.dim() == 4 else -1
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return t.narrow(dim, rows[0], len(rows))
    return t.index_select(dim, torch.tensor(rows, device=t.device))


def _renumber(idx: torch.Tensor, new_of_old: list[int]) -> torch.Tensor:
    """Block numbers in `idx` mapped old -> new (skipped when the map is the identity)."""
    if new_of_old == list(range(len(new_of_old))):
        return idx
    return torch.tensor(new_of_old, dtype=idx.dtype, device=idx.device)[idx.long()]


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for new, old in enumerate(perm):
        inv[old] = new
    return inv


def derive_tables(
    tables: tuple,
    q: Positions,
    kv: Positions,
    block_size: tuple[int, int],
    heads: tuple[int, int] | None = None,
) -> tuple:
    """The BlockMask tensors of a (q buffer x key buffer) attention from the GLOBAL mask's tensors.

    `tables`: (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices,
    full_q_num_blocks, full_q_indices) of the mask built for the whole sequence (full_* may be None); `q` / `kv`
    say which global tokens the buffers hold; `heads` = (first, count) slices a per-head mask to a rank's heads.
    The kv tables are the buffer's q-block rows with kv blocks renumbered into the key buffer's order; the q
    tables (for backward) are the global ones permuted the same way when the q buffer holds every block, else the
    transpose of the derived kv tables (a rank's rows only).
    """
    kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx = tables
    if heads is not None and kv_num.shape[1] > 1:
        first, count = heads
        sliced = [t.narrow(1, first, count) if t is not None else None for t in tables]
        kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx = sliced
    q_rows = q.global_blocks(block_size[0], kv.tokens)
    kv_cols = kv.global_blocks(block_size[1], kv.tokens)
    n_kv = kv_idx.shape[-1]
    if len(kv_cols) != n_kv:
        raise AssertionError(f"key buffer has {len(kv_cols)} blocks, the mask {n_kv}")  # the planner checked
    kv_new = _inverse(kv_cols)
    out_kv = [_rows(kv_num, q_rows), _renumber(_rows(kv_idx, q_rows), kv_new)]
    out_fkv = [None, None]
    if fkv_num is not None:
        out_fkv = [_rows(fkv_num, q_rows), _renumber(_rows(fkv_idx, q_rows), kv_new)]
    if q_idx is not None and len(q_rows) == q_idx.shape[-1]:  # every q block: permute the global q tables
        q_new = _inverse(q_rows)
        out_q = [_rows(q_num, kv_cols), _renumber(_rows(q_idx, kv_cols), q_new)]
        out_fq = [None, None]
        if fq_num is not None:
            out_fq = [_rows(fq_num, kv_cols), _renumber(_rows(fq_idx, kv_cols), q_new)]
    else:  # a rank's q blocks only: the q tables of its derived kv tables
        out_q = list(transpose_tables(*out_kv, n_kv))
        out_fq = list(transpose_tables(*out_fkv, n_kv)) if fkv_num is not None else [None, None]
    return (*out_kv, *out_fkv, *out_q, *out_fq)
