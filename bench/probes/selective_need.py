"""What comm="selective" needs on the bench's document mixes (CPU, no GPU): per rank pair, the K/V tokens a rank
reads from one peer under thd_balanced's plan and under thd, against C = min(T/cp, max_q) with max_q the batch's
longest document (docs/architecture.md, "Selective exchange").

Prints, per mix x cp x tokens a rank: the largest need from one peer (as a fraction of T/cp and of the longest
document), the largest total a rank reads (as a fraction of the all-gather's (cp - 1) T/cp), and the mean.

    python -m bench.probes.selective_need
"""

from __future__ import annotations

import torch

from bench.thd_cases import MIXES, doc_lengths
from cpcompile.comms.selective.schedule import capacity, select, select_thd
from cpcompile.layouts import get_packed_layout


def need(layout: str, lengths: list[int], cp: int, causal: bool = True) -> torch.Tensor:
    """(reader, owner) K/V tokens reader r's queries read from owner p (0 on the diagonal)."""
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    cu = get_packed_layout(layout).prepare(cu, total, cp)
    pick = select if layout == "thd_balanced" else select_thd
    return pick(cu, total // cp, cp, 0, causal, total // cp).need


def main() -> None:
    for layout in ("thd_balanced", "thd"):
        for mix in MIXES:
            for cp in (2, 4, 8):
                for local in (8192, 32768):
                    lengths = doc_lengths(local * cp, mix)
                    n, longest = need(layout, lengths, cp), max(lengths)
                    pair, rank = int(n.max()), n.sum(1)
                    gather = (cp - 1) * local
                    most, mean = int(rank.max()) / gather, float(rank.float().mean()) / gather
                    print(
                        f"{layout:12s} {mix} cp={cp} T/cp={local} longest={longest} C={capacity(local, longest)}: "
                        f"one peer {pair} ({pair / local:.2f} T/cp, {pair / longest:.2f} longest); a rank at most "
                        f"{most:.2f}, mean {mean:.2f} of the all-gather"
                    )


if __name__ == "__main__":
    main()
