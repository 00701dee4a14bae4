"""thd_balanced: packed documents with equal tokens AND equal causal work per rank, no divisibility rule.

thd cuts the buffer into equal tokens, not equal work (a rank holding a long document's tail does most of it);
thd_zigzag balances work by cutting every document into 2*cp chunks (a 1K document at cp=8 becomes 64-token
pieces that run far below the kernel's rate) and needs every length to be a multiple of 2*cp. Here each rank
owns exactly T/cp tokens as a few PIECES (contiguous runs of one document): short documents whole, long ones
cut where the work balances (layouts/balance.py, chosen per batch on the host). E.g. cp=2, documents A (12
tokens) and b, c, d, e (1 token each), T=16, 8 tokens a rank (A's causal work is 78 of the 82):

    global:  A0 A1 A2 A3 A4 A5 A6 A7 A8 A9 A10 A11 b c d e
    rank 0:  A0 A1 A2 | A9 A10 A11 | d | e          A's front and back (a zigzag pair) + 2 whole: work 6+33+1+1
    rank 1:  A3 A4 A5 A6 A7 A8 | b | c              A's middle + 2 whole documents:            work 39+1+1

A rank's pieces are in global order, so its local buffer is the concatenation of its pieces.

The plan rides in cu_seqlens. varlen_attn takes only cu_seqlens (and max_q/max_k), and documents change every
batch, so the plan must reach the region as device data of a static shape. `shard_batch` (or `plan_documents`)
returns in place of cu_seqlens one longer int tensor, which the model passes to varlen_attn as it is:

    [ offsets (n: the padded cu_seqlens) | starts (cp x P) | lengths (cp x P) | -(2**30 + cp) ]

the first n entries the true global offsets; then per rank its P piece slots, rank-major, each the global start
and length of a piece in local order (unused slots: start T, length 0); then a tag. P = ceil((n - 1) / cp) + 4
(a rank holds at most its share of documents plus 4), so n, P and every shape follow from the length and cp at
compile time: new documents never recompile, and nothing reads the plan on the host. The alternative, an extra
model input, would change the model's code and need the pass to guess which input it is. A plain cu_seqlens
is refused: at compile time when its length is not a plan's, else at run time (the tag is negative, offsets
never are) by the packed-metadata check, which also checks the whole plan (a permutation of the buffer into
in-document pieces, equal tokens, <= 2 pieces of a document a rank, the key budget) on every rank.

Under the all-gather region a rank's attention is ONE varlen block over a key buffer holding, per piece, its
document's keys up to the piece's end (causal; the whole document once under full attention, where a
document's two pieces are adjacent and form one q range), copied from the gather: rank 0 above reads
A0..A2 then A0..A11 then d then e. Its size is static, K = (cp + 1) * T/cp (the solver keeps every rank within
it: one long document needs T + T/(2cp)); the tail past the last range is never read, by the kernel or by the
fold of the gradient. One sequence per piece: P sequences a call, each bounded by the longest document.
"""

from __future__ import annotations

import torch

from ..errors import CPCompileError
from ..log import log
from .balance import BalanceError, balance
from .block import NO_WINDOW
from .search import sorted_search
from .thd import PackedLayout, VarlenBlock, doc_bound

EXTRA_PIECES = 4
"""Piece slots a rank has beyond its share of the documents (cuts, and the sweep's uneven counts)."""
TAG = 1 << 30
"""The plan's last entry is -(TAG + cp): negative, which offsets never are."""


def pieces_per_rank(n_offsets: int, cp: int) -> int:
    """P: the piece slots of each rank for a cu_seqlens of `n_offsets` entries (n_offsets - 1 documents)."""
    return -(-(n_offsets - 1) // cp) + EXTRA_PIECES


def plan_length(n_offsets: int, cp: int) -> int:
    """Entries of the plan tensor for `n_offsets` offsets at `cp` ranks."""
    return n_offsets + 2 * cp * pieces_per_rank(n_offsets, cp) + 1


def split_plan_length(length: int, cp: int) -> tuple[int, int] | None:
    """(n_offsets, P) of a plan tensor of `length` entries, or None if no plan for cp has that length."""
    lo, hi = 1, max(length, 1)
    while lo < hi:  # plan_length is strictly increasing in n_offsets
        mid = (lo + hi) // 2
        if plan_length(mid, cp) < length:
            lo = mid + 1
        else:
            hi = mid
    return (lo, pieces_per_rank(lo, cp)) if plan_length(lo, cp) == length else None


def key_budget(local_len: int, cp: int) -> int:
    """K: the static length of every rank's key buffer (the sum of its pieces' document prefixes fits)."""
    return (cp + 1) * local_len


def is_plan(cu: torch.Tensor) -> bool:
    """Whether a host cu_seqlens is a plan (ends with a negative tag) rather than plain offsets."""
    return cu.numel() > 0 and int(cu[-1]) < 0


def make_plan(cu: torch.Tensor, cp: int) -> torch.Tensor:
    """The plan tensor (same dtype and device as `cu`) for plain GLOBAL offsets `cu`, checked by the caller."""
    offsets = [int(x) for x in cu.tolist()]
    total, n_offsets = offsets[-1], len(offsets)
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    try:
        ranks, balanced = balance(lengths, cp, pieces_per_rank(n_offsets, cp), key_budget(total // cp, cp))
    except BalanceError as e:
        raise CPCompileError(
            f"thd_balanced found no plan for these {sum(n > 0 for n in lengths)} documents ({e}). Fix: pad "
            "cu_seqlens to more entries (cpcompile.pad_cu_seqlens(cu, T, length)): each entry adds piece slots"
        ) from None
    if not balanced:
        log.warning(
            "thd_balanced: no balanced plan of these %d documents fits %d pieces a rank at cp=%d; this batch uses "
            "equal contiguous runs (equal tokens, work NOT balanced). Fix: pad cu_seqlens to more entries "
            "(cpcompile.pad_cu_seqlens(cu, T, length)): each entry adds piece slots",
            sum(n > 0 for n in lengths),
            pieces_per_rank(n_offsets, cp),
            cp,
        )
    slots = pieces_per_rank(n_offsets, cp)
    starts, lens = [], []
    for pieces in ranks:
        placed = sorted((offsets[d] + a, b - a) for d, a, b in pieces)
        placed += [(total, 0)] * (slots - len(placed))
        starts += [s for s, _ in placed]
        lens += [n for _, n in placed]
    return cu.new_tensor(offsets + starts + lens + [-(TAG + cp)])


class Plan:
    """The plan decoded on device (static slices of the tensor), and rank `rank`'s pieces derived from it."""

    def __init__(self, cu: torch.Tensor, cp: int):
        split = split_plan_length(cu.numel(), cp)
        if split is None:
            raise CPCompileError(f"thd_balanced: {cu.numel()} entries are not a plan's for cp={cp}")
        n, p = split
        v = cu.long()
        self.cp, self.slots = cp, p
        self.offsets, self.tag = v[:n], v[-1]
        self.starts = v[n : n + cp * p].view(cp, p)
        self.lens = v[n + cp * p : n + 2 * cp * p].view(cp, p)
        self.local_start = self.lens.cumsum(1) - self.lens  # each piece's first local position

    def documents(self, starts: torch.Tensor) -> torch.Tensor:
        """The document holding each global position (unused slots: the last, empty, document)."""
        return (sorted_search(self.offsets, starts, right=True) - 1).clamp(0, self.offsets.numel() - 2)

    def sequences(self, rank: int, causal: bool):
        """Per piece slot: (q start, q end, key start, key end, document start, second piece of its document)."""
        s, n, q0 = self.starts[rank], self.lens[rank], self.local_start[rank]
        doc = self.documents(s)
        d0, d1 = self.offsets[doc], self.offsets[doc + 1]
        second = torch.cat((doc.new_zeros(1, dtype=torch.bool), doc[1:] == doc[:-1])) & (n > 0)
        if causal:  # a piece attends its document's keys up to its own last token
            qs, qe, keys = q0, q0 + n, torch.where(n > 0, s + n - d0, 0)
        else:  # a document's two pieces are adjacent here: one q range against the whole document, once
            after = torch.cat((second[1:], second.new_zeros(1)))
            qs = torch.where(second, q0 + n, q0)
            qe = torch.where(second, q0 + n, q0 + n + torch.where(after, n.roll(-1), 0))
            keys = torch.where(second | (n == 0), 0, d1 - d0)
        k0 = keys.cumsum(0) - keys
        return qs, qe, k0, k0 + keys, d0, second & causal

    def key_buffer(self, rank: int, causal: bool, local_len: int, position, held: int):
        """(index, fold) of rank `rank`'s key buffer (PackedLayout.key_buffer) over a source buffer of `held`
        tokens in which global position g sits at `position(g)`: the all-gather buffer (held = T), or the
        selective exchange's own + received tokens (comms/selective/schedule.py)."""
        _, _, k0, k1, d0, second = self.sequences(rank, causal)
        total, size = self.cp * local_len, key_budget(local_len, self.cp)
        i = torch.arange(size, device=k1.device)
        piece = sorted_search(k1, i, right=True).clamp(max=self.slots - 1)
        tail = i >= k1[-1]  # past the last range: never read
        g = (d0[piece] + i - k0[piece]).clamp(0, total - 1)
        index = torch.where(tail, 0, position(g))
        copies = 2 if causal else 1  # a document's front and back piece both read its first keys
        target = torch.where(tail, copies * held + i, second.long()[piece] * held + index)  # all distinct
        fold = torch.full((copies * held + size,), -1, dtype=torch.int64, device=i.device)
        return index, fold.index_put_((target,), i)[: copies * held].view(copies, held)

    def gathered_position(self, g: torch.Tensor, local_len: int) -> torch.Tensor:
        """Position in the rank-major all-gather buffer of each global position `g` (< T)."""
        starts, order = self.starts.flatten().sort(stable=True)
        j = (sorted_search(starts, g, right=True) - 1).clamp(min=0)
        piece = order[j]
        owner = torch.div(piece, self.slots, rounding_mode="floor")
        return owner * local_len + self.local_start.flatten()[piece] + (g - starts[j])


class ThdBalancedLayout(PackedLayout):
    """Equal tokens and equal causal work a rank: whole short documents, long ones in balanced pieces."""

    name = "thd_balanced"
    carries_plan = True

    def cu_problem(self, length, cp: int) -> tuple[str, str] | None:
        if not isinstance(length, int):
            return (
                "strategy='thd_balanced' reads this batch's plan from cu_seqlens, whose length must be static",
                "pad cu_seqlens to a fixed length before planning (cpcompile.pad_cu_seqlens(cu, T, length)) and "
                "do not mark it dynamic",
            )
        if split_plan_length(length, cp) is None:
            return (
                f"strategy='thd_balanced' reads this batch's plan from cu_seqlens (the offsets, then each rank's "
                f"pieces), and {length} entries are not a plan's for cp={cp}: plain offsets are not enough",
                "pass the cu_seqlens that cpcompile.shard_batch(batch, strategy='thd_balanced', ...) returns (or "
                "cpcompile.plan_documents(cu_seqlens, strategy='thd_balanced')) to the model",
            )
        return None

    def offsets(self, cu_seqlens, cp):
        return Plan(cu_seqlens, cp).offsets

    def is_plan(self, cu_seqlens):
        return is_plan(cu_seqlens)

    def prepare(self, cu_seqlens, total, cp):
        if not is_plan(cu_seqlens):
            return make_plan(cu_seqlens, cp)
        if split_plan_length(cu_seqlens.numel(), cp) is None or int(cu_seqlens[-1]) != -(TAG + cp):
            tagged = -int(cu_seqlens[-1]) - TAG
            raise CPCompileError(
                f"cu_seqlens ends with {int(cu_seqlens[-1])}: a thd_balanced plan for cp={tagged} (or not a "
                f"plan), used at cp={cp}. Fix: plan this batch for this CP group (cpcompile.shard_batch or "
                "cpcompile.plan_documents with the same mesh/group)"
            )
        if not bool(self.metadata_ok(cu_seqlens.cpu(), total, cp, None)):
            raise CPCompileError(
                f"cu_seqlens is not a valid thd_balanced plan for packed length {total} at cp={cp} (pieces must "
                "tile the buffer in order within documents, T/cp tokens a rank). Fix: pass the plan "
                "cpcompile.shard_batch / cpcompile.plan_documents returned for this batch, unchanged"
            )
        return cu_seqlens

    def metadata_ok(self, cu_seqlens, total, cp, max_doc):
        plan = Plan(cu_seqlens, cp)
        cu, starts, lens, local = plan.offsets, plan.starts, plan.lens, total // cp
        ok = super().metadata_ok(cu, total, cp, max_doc) & (plan.tag == -(TAG + cp))
        ok &= (lens >= 0).all() & (lens.sum(1) == local).all() & ((lens > 0) | (starts == total)).all()
        ok &= (starts[:, 1:] >= starts[:, :-1]).all()  # local order = global order
        flat, order = starts.flatten().sort(stable=True)
        ok &= (flat[0] == 0) & (flat[1:] == flat[:-1] + lens.flatten()[order][:-1]).all()  # a partition of [0, T)
        first, last = plan.documents(starts), plan.documents(starts + lens - 1)
        ok &= ((lens == 0) | (first == last)).all()  # inside one document
        again = (first[:, 1:] == first[:, :-1]) & (lens[:, 1:] > 0)
        ok &= ~(again[:, 1:] & again[:, :-1]).any()  # at most 2 pieces of a document a rank
        keys = torch.where(lens > 0, starts + lens - cu[first], 0).sum(1)
        return ok & (keys <= key_budget(local, cp)).all()

    def bad_metadata_message(self, total, max_doc, cp):
        bound = "" if max_doc is None else f", docs <= max_q/max_k={max_doc}"
        return (
            f"cpcompile: bad thd_balanced cu_seqlens (T={total}, cp={cp}{bound}): pass the plan "
            "cpcompile.shard_batch/plan_documents(strategy='thd_balanced') returned, unchanged, not plain offsets"
        )

    def shard_index(self, cu_seqlens, total, cp, rank):
        plan = Plan(cu_seqlens, cp)
        q0, n = plan.local_start[rank], plan.lens[rank]
        j = torch.arange(total // cp, device=cu_seqlens.device)
        piece = sorted_search(q0 + n, j, right=True).clamp(max=plan.slots - 1)
        return plan.starts[rank][piece] + (j - q0[piece])

    def key_buffer(self, cu_seqlens, local_len, cp, rank, causal):
        plan = Plan(cu_seqlens, cp)
        return plan.key_buffer(rank, causal, local_len, lambda g: plan.gathered_position(g, local_len), cp * local_len)

    def held_key_buffer(self, cu_seqlens, local_len, cp, rank, causal, held_position, held):
        """`key_buffer` over the selective exchange's held buffer of `held` tokens (comms/selective/schedule.py), where
        global position g sits at `held_position[g]`."""
        plan = Plan(cu_seqlens, cp)
        return plan.key_buffer(rank, causal, local_len, lambda g: held_position[g], held)

    def blocks(self, cu_seqlens, local_len, cp, rank, causal, max_doc=None, window=NO_WINDOW):
        qs, qe, k0, k1, _, _ = Plan(cu_seqlens, cp).sequences(rank, causal)
        bounds = (doc_bound(local_len, max_doc), doc_bound(cp * local_len, max_doc))
        # pieces tile the local buffer and every row sees itself; every key up to the last range's end lies in a
        # range with rows, the tail after it is unused (see VarlenBlock.covers_keys)
        return [VarlenBlock(0, causal, torch.stack((qs, qe, k0, k1)), *bounds, window, True, True)]
