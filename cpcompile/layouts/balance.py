"""The host-side solver of the thd_balanced layout: which pieces of which documents each CP rank owns.

Pure Python on the document lengths (the data loader's side, once per batch; no torch). Each rank gets exactly
L = T / cp tokens, and as near as it can the same causal attention work: a piece [a, b) of a document (token
positions inside it) costs `piece_work(a, b)` score entries, token t seeing t + 1 keys. Documents stay whole
where the balance allows; a rank holds at most `max_pieces` pieces (the sequences of its one kernel call) and at
most 2 of any document, and reads at most `max_keys` keys (its key buffer: each piece's document prefix).

An assignment this solver makes (cp = 4, T = 32, 8 tokens a rank; documents A of 20 tokens, B of 6, c and d
of 2, e and f of 1; causal work 239, 59.75 a rank):

    global:  A0 ........................... A19 | B0 ... B5 | c c | d d | e | f
    rank 0:  A0..A5          A18 A19              work 21 + 39          = 60   A's front and back (a pair)
    rank 1:  A6..A11         e f                  work 57 + 1 + 1       = 59
    rank 2:  A15..A17        B0  c c  d d         work 51 + 1 + 3 + 3   = 58
    rank 3:  A12..A14        B1..B5               work 42 + 20          = 62

Only A (longer than T/cp) and B are cut; c, d, e, f stay whole. Each rank holds its pieces in global order.

The sweep. Documents not yet placed are "units" (one contiguous remainder [a, b) per document), ordered by
density (work per token, (a + b + 1) / 2: long documents' tails first, short documents last). Rank by rank, the
rank takes x tokens from the dense end (whole units, then the BACK part of one) and the rest from the sparse end
(whole units, then the FRONT part of one), with x chosen so that its work meets its share of what is left (an
intermediate value: x = 0 gives the rank too little work, x = L too much). So every unit stays one contiguous
remainder, and a rank takes at most 2 pieces of a document (its front and back, when the two ends meet in one
unit: the zigzag pair of a document longer than the rest). Boundaries snap to whole units when that costs at
most `tolerance` of the mean work, preferring to cut a long document over a short one. The last rank takes
what remains, which by construction is exactly L tokens with its share of the work.

The sparse end would give the first ranks every tiny document (too many pieces), so the k shortest documents
are dealt first, snake-wise (rank 0..cp-1, then back): equal counts, nearly equal tokens, and too little work to
matter; the sweep balances the rest around them. k is the smallest (binary search) for which every rank stays
within `max_pieces` and `max_keys`.
"""

from __future__ import annotations

import bisect

Piece = tuple[int, int, int]
"""(document, first position in it, end position): positions [a, b) of one document."""


PAIR_SPARSE_UNITS = 8
"""Pair candidates try 0..this many whole units from the sparse end."""


class BalanceError(ValueError):
    """No assignment within the piece and key bounds was found (the caller turns it into a CPCompileError)."""


def piece_work(a: int, b: int) -> int:
    """Causal score entries of positions [a, b) of one document: token t sees its t + 1 first keys."""
    return (b - a) * (a + b + 1) // 2


def rank_work(pieces: list[Piece]) -> int:
    return sum(piece_work(a, b) for _, a, b in pieces)


def _density_class(a: int, b: int) -> int:
    """Densities in classes an eighth of an octave wide (integer math: every rank computes the same plan)."""
    v = a + b + 1
    e = v.bit_length()
    return e * 8 + (v >> max(e - 4, 0)) % 8 if e > 3 else v


class _Sweep:
    """The units not yet placed, densest first, and the two-ended take of one rank.

    Order: density class, then units already cut before whole ones (so a document is used up before the next
    of about the same density is cut: fewer remainders, fewer pieces for the ranks that collect them), then
    density, length and document index."""

    def __init__(self, units: list[Piece], tolerance: int):
        self.whole = {doc: (a, b) for doc, a, b in units}
        self.units = sorted(self._entry(*u) for u in units)
        self.tolerance = tolerance

    def _entry(self, doc: int, a: int, b: int) -> tuple:
        cut = self.whole[doc] != (a, b)
        return (-_density_class(a, b), -cut, -(a + b), -(b - a), doc), doc, a, b

    def work(self) -> int:
        return sum(piece_work(a, b) for _, _, a, b in self.units)

    def take(self, tokens: int, work: int, key_room: int) -> list[Piece]:
        """Remove and return `tokens` tokens of units whose work is as near `work` as the sweep allows, reading
        at most `key_room` keys (the pieces' ends) where a candidate does.

        Candidates: the two-ended split (x from the dense end, the rest from the sparse end), its boundaries
        snapped to unit edges, and pairs (whole units from the sparse end, the rest as the front and back of
        one unit from the dense end: the zigzag pair, which cuts one document instead of two). Among those
        within the tolerance of the best, the one that cuts the fewest whole documents wins, a document cut
        only at its front (which leaves its dense back for later) least of all.

        A selection is (i, j, parts): units[:i] and units[j:] whole, parts {unit: (front, back)} of at most two
        more units; its work comes from prefix sums."""
        if tokens == 0:
            return []
        units = self.units
        lens = [b - a for _, _, a, b in units]
        pt, pw, pk = [0], [0], [0]
        for n, (_, _, a, b) in zip(lens, units):
            pt.append(pt[-1] + n)
            pw.append(pw[-1] + piece_work(a, b))
            pk.append(pk[-1] + b)
        total, m = pt[-1], len(units)
        if tokens > total:
            raise BalanceError(f"internal: a rank needs {tokens} tokens, {total} are left")

        def part_work(k: int, f: int, g: int) -> int:  # front f and back g of unit k
            _, _, a, b = units[k]
            return piece_work(a, a + f) + piece_work(b - g, b)

        def weigh(sel) -> int:
            i, j, parts = sel
            return pw[i] + pw[m] - pw[j] + sum(part_work(k, f, g) for k, (f, g) in parts.items())

        def keys(sel) -> int:  # each piece reads its document's keys up to its end
            i, j, parts = sel
            ends = 0
            for k, (f, g) in parts.items():
                _, _, a, b = units[k]
                ends += b if f + g >= b - a else (a + f) * bool(f) + b * bool(g)
            return pk[i] + pk[m] - pk[j] + ends

        def two_ended(x: int):
            """x tokens from the dense end (whole units, then a back), tokens - x from the sparse end."""
            i, j, parts = 0, m, {}
            if x:
                i = bisect.bisect_left(pt, x) - 1
                parts[i] = (0, x - pt[i])
            if y := tokens - x:
                j = bisect.bisect_right(pt, total - y) - 1
                f = y - (total - pt[j + 1])
                parts[j] = (parts.get(j, (0, 0))[0] + f, parts.get(j, (0, 0))[1])
                j += 1
            return i, j, parts

        lo, hi = 0, tokens  # an intermediate value: all-sparse gives too little work, all-dense too much
        if weigh(two_ended(hi)) <= work:
            lo = hi
        elif weigh(two_ended(lo)) < work:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if weigh(two_ended(mid)) >= work else (mid, hi)
        x = min((lo, hi), key=lambda v: abs(weigh(two_ended(v)) - work))
        i, j = bisect.bisect_left(pt, max(x, 1)) - 1, bisect.bisect_right(pt, total - max(tokens - x, 1)) - 1
        near = {x} | {pt[k] for k in range(max(0, i - 2), min(m, i + 3))}
        near |= {tokens - (total - pt[k]) for k in range(max(0, j - 2), min(m, j + 3))}
        candidates = [two_ended(v) for v in sorted(near) if 0 <= v <= tokens]
        for sparse in range(min(m - 1, PAIR_SPARSE_UNITS) + 1):  # pairs after `sparse` whole sparse-end units
            rest = tokens - (total - pt[m - sparse])
            if rest < 0:
                break
            if (pair := self._pair(rest, work - (pw[m] - pw[m - sparse]), m - sparse, pt, pw, part_work)) is not None:
                candidates.append((pair[0], m - sparse, pair[1]))
        fitting = [c for c in candidates if keys(c) <= key_room] or candidates  # else the caller refuses the plan
        return self._remove(self._best(fitting, [abs(weigh(c) - work) for c in fitting], lens))

    def _pair(self, rest, need, limit, pt, pw, part_work) -> tuple[int, dict[int, tuple[int, int]]] | None:
        """`rest` tokens from units[:limit]: whole ones from the dense end, then the front and back of one unit
        with work as near `need` as its split allows (moving a token from its front to its back adds work)."""
        if rest == 0:
            return 0, {}
        i = bisect.bisect_left(pt, rest) - 1
        if i >= limit:
            return None
        q, base = rest - pt[i], pw[i]
        lo, hi = 0, q
        while hi - lo > 1:  # back g, front q - g
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if base + part_work(i, q - mid, mid) >= need else (mid, hi)
        g = min((lo, hi), key=lambda v: abs(base + part_work(i, q - v, v) - need))
        return i, {i: (q - g, g)}

    def _best(self, candidates: list, error: list[int], lens: list[int]):
        """The candidate within the tolerance of the best error that cuts fewest whole documents (a front-only
        cut least of all), then fewest units, then nearest."""
        allowed = max(self.tolerance, min(error))

        def score(n: int):
            front_only = new = cut = 0
            for k, (f, g) in candidates[n][2].items():
                if 0 < f + g < lens[k]:
                    _, d, a, b = self.units[k]
                    fresh = self.whole[d] == (a, b)
                    cut, new, front_only = cut + 1, new + fresh, front_only + (fresh and not g)
            i, j, parts = candidates[n]
            return (front_only, new, cut, error[n], i, -j, sorted(parts.items()))

        return candidates[min((n for n in range(len(candidates)) if error[n] <= allowed), key=score)]

    def _remove(self, sel) -> list[Piece]:
        """Take the selection off the units; the rest keep their order, trimmed units re-sorted."""
        i, j, parts = sel
        units = self.units
        taken = [(d, a, b) for _, d, a, b in units[:i] + units[j:]]
        kept = [u for k, u in enumerate(units[i:j], i) if k not in parts]
        for k, (f, g) in parts.items():
            _, d, a, b = units[k]
            if f + g >= b - a:
                taken.append((d, a, b))
                continue
            taken += [(d, a, a + f)] * bool(f) + [(d, b - g, b)] * bool(g)
            bisect.insort(kept, self._entry(d, a + f, b - g))
        self.units = kept
        return taken

    def rest(self) -> list[Piece]:
        out = [(doc, a, b) for _, doc, a, b in self.units]
        self.units = []
        return out


def _plan(
    docs: list[tuple[int, int]], cp: int, local: int, dealt: int, tolerance: float, max_keys: int
) -> list[list[Piece]]:
    """The sweep over `docs` ((length, document), shortest first) with the `dealt` shortest dealt snake-wise first."""
    ranks: list[list[Piece]] = [[] for _ in range(cp)]
    for i, (n, d) in enumerate(docs[:dealt]):
        turn, pos = divmod(i, cp)
        ranks[pos if turn % 2 == 0 else cp - 1 - pos].append((d, 0, n))
    tokens = [sum(b - a for _, a, b in r) for r in ranks]
    if max(tokens) > local:
        raise BalanceError("the dealt documents overfill a rank")
    mean = sum(piece_work(0, n) for n, _ in docs) // cp
    sweep = _Sweep([(d, 0, n) for n, d in docs[dealt:]], int(tolerance * mean))
    dealt_work = [rank_work(r) for r in ranks]
    left = sweep.work() + sum(dealt_work)  # the work of ranks r.. and of the units
    for r in range(cp - 1):
        taken = sweep.take(local - tokens[r], left // (cp - r) - dealt_work[r], max_keys - tokens[r])
        ranks[r] += taken
        left -= dealt_work[r] + rank_work(taken)
    ranks[-1] += sweep.rest()
    return ranks


def _within(ranks: list[list[Piece]], max_pieces: int, max_keys: int) -> bool:
    return all(len(r) <= max_pieces and sum(b for _, _, b in r) <= max_keys for r in ranks)


def contiguous(docs: list[tuple[int, int]], cp: int, local: int) -> list[list[Piece]]:
    """The fallback: documents cut into cp contiguous runs of `local` tokens over a reordered buffer. Rank r
    takes the rest of the document rank r - 1 cut, then k of the shortest documents left and enough of the
    longest to fill exactly (the last one cut, its rest carried to rank r + 1), k as large as keeps the rank
    within its share of the documents + 1. One piece of a document a rank and keys <= T; its piece count is
    checked like the sweep's. Its work is NOT balanced (a long document's tail lands on one rank): used only
    when the sweep finds nothing within the bounds."""
    left = sorted(docs)  # (length, document), shortest first
    ranks: list[list[Piece]] = [[] for _ in range(cp)]
    carry: Piece | None = None  # (document, first position not yet placed, length)
    for r in range(cp):
        room, out = local, ranks[r]
        if carry is not None:
            d, a, n = carry
            step = min(room, n - a)
            out.append((d, a, a + step))
            room, carry = room - step, ((d, a + step, n) if a + step < n else None)
        share = -(-len(left) // (cp - r))
        small, large = [0], [0]  # tokens of the k shortest, of the m longest
        for n, _ in left:
            small.append(small[-1] + n)
        for n, _ in reversed(left):
            large.append(large[-1] + n)
        best = None
        for k in range(len(left) + 1):
            if small[k] > room:
                break
            m = bisect.bisect_left(large, room - small[k])  # the m longest fill the rest (the last one cut)
            if k + m <= len(left) and (best is None or k + m <= share + 1):
                best = (k, m)
        k, m = best if best is not None else (0, 0)
        for n, d in left[:k]:
            out.append((d, 0, n))
            room -= n
        for n, d in reversed(left[len(left) - m :]) if m else []:
            out.append((d, 0, min(room, n)))
            carry = (d, room, n) if room < n else carry
            room -= min(room, n)
        left = left[k : len(left) - m]
        if room:
            raise BalanceError("internal: the contiguous fallback ran out of tokens")
    if carry is not None or left:
        raise BalanceError("internal: the contiguous fallback left tokens over")
    return ranks


def _deal_fits(docs: list[tuple[int, int]], cp: int, local: int) -> int:
    """The most shortest documents the snake-wise deal can take before a rank holds more than `local` tokens."""
    tokens = [0] * cp
    for i, (n, _) in enumerate(docs):
        turn, pos = divmod(i, cp)
        r = pos if turn % 2 == 0 else cp - 1 - pos
        if tokens[r] + n > local:
            return i
        tokens[r] += n
    return len(docs)


SCAN = 24
"""Dealt counts tried one by one (evenly spaced) when the bisection finds none within the bounds."""


def balance(
    lengths: list[int], cp: int, max_pieces: int, max_keys: int, tolerance: float = 0.01
) -> tuple[list[list[Piece]], bool]:
    """(per rank its pieces (document, a, b), balanced): exactly sum(lengths) / cp tokens each, at most
    `max_pieces` pieces and `max_keys` keys a rank (sum of the pieces' ends b: each reads its document's prefix),
    causal work balanced when `balanced`.

    The number k of shortest documents dealt first is searched among the counts that deal whole length classes
    (all documents of a length or none: tiny documents are often of few lengths) and fit the ranks, smallest
    first by bisection (fewer pieces as k grows, mostly), then SCAN counts one by one. If none fits: the
    contiguous fallback, `balanced` False (the caller says so). Raises BalanceError when even that exceeds the
    bounds."""
    docs = sorted((n, d) for d, n in enumerate(lengths) if n > 0)
    local = sum(lengths) // cp
    most = _deal_fits(docs, cp, local)
    ks = [0] + [k for k in range(1, most + 1) if k == len(docs) or docs[k][0] != docs[k - 1][0]]

    def attempt(dealt: int) -> list[list[Piece]] | None:
        try:
            ranks = _plan(docs, cp, local, dealt, tolerance, max_keys)
        except BalanceError:
            return None
        return ranks if _within(ranks, max_pieces, max_keys) else None

    if (ranks := attempt(0)) is not None:
        return ranks, True
    lo, hi, best = 0, len(ks) - 1, None  # attempt(ks[lo]) failed; more dealt documents, fewer pieces
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if (ranks := attempt(ks[mid])) is not None:
            hi, best = mid, ranks
        else:
            lo = mid
    if best is not None or (hi > 0 and (best := attempt(ks[hi])) is not None):
        return best, True
    step = max(1, len(ks) // SCAN)
    for i in range(len(ks) - 1, 0, -step):
        if (ranks := attempt(ks[i])) is not None:
            return ranks, True
    ranks = contiguous(docs, cp, local)
    if not _within(ranks, max_pieces, max_keys):
        raise BalanceError(
            f"no assignment of {len(docs)} documents within {max_pieces} pieces and {max_keys} keys a rank"
        )
    return ranks, False
