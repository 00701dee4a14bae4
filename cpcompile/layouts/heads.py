"""Which heads each rank attends after the heads<->sequence exchange (pure math, no torch.distributed).

Rank j gets q heads [j*Hq/cp, (j+1)*Hq/cp). Its k/v heads are the ones those q heads read under grouped-query
attention: Hkv/cp heads when Hkv >= cp, else ONE kv head, replicated to the cp/Hkv ranks that share it (never
all kv heads), with its gradient summed back in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass


def head_split_problem(q_heads: int, kv_heads: int, cp: int) -> tuple[str, str] | None:
    """None when the heads split evenly over cp ranks, else (rule broken, fix) for a planner error."""
    fix_cp = "use a CP size that divides the head counts, or comm='all_gather' (which shards no heads)"
    if q_heads % cp:
        return (f"comm='a2a' gives each of the {cp} ranks q_heads/cp heads, but there are {q_heads} q heads", fix_cp)
    if kv_heads >= cp and kv_heads % cp:
        return (
            f"comm='a2a' gives each of the {cp} ranks kv_heads/cp k/v heads, but there are {kv_heads} kv heads",
            fix_cp,
        )
    if kv_heads < cp and cp % kv_heads:
        return (
            f"with {kv_heads} kv heads < cp={cp}, comm='a2a' replicates each kv head to cp/kv_heads ranks, "
            f"which needs cp to be a multiple of {kv_heads}",
            fix_cp,
        )
    return None


@dataclass(frozen=True)
class HeadSplit:
    """The per-rank head counts of an a2a exchange (validated by head_split_problem beforehand)."""

    q_heads: int
    kv_heads: int
    cp: int

    @property
    def q_per_rank(self) -> int:
        return self.q_heads // self.cp

    @property
    def kv_per_rank(self) -> int:
        return max(self.kv_heads // self.cp, 1)

    @property
    def kv_replicas(self) -> int:
        """How many ranks read each kv head (1 unless kv_heads < cp)."""
        return max(self.cp // self.kv_heads, 1)

    def kv_heads_of(self, rank: int) -> list[int]:
        """The kv heads rank `rank`'s q heads read (GQA maps q head i to kv head i // (q_heads // kv_heads))."""
        first = rank * self.kv_heads // self.cp
        return list(range(first, first + self.kv_per_rank))
