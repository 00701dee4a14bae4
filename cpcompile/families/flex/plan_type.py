"""The flex family's plan: the mods and BlockMask are region inputs, the mask's geometry constants."""

from __future__ import annotations

from dataclasses import dataclass

from ...sharding.flex import strip_marker
from ..plans import CPPlan
from .call import FlexCall


@dataclass(frozen=True)
class FlexPlan(CPPlan):
    """A CPPlan for a flex_attention site: the mods and BlockMask are region inputs, the mask's geometry constants."""

    masked: bool = True
    """The BlockMask came from shard_block_mask (its tables are derived per rank); False: no mask was given."""
    block_size: tuple[int, int] = (128, 128)
    kernel_options: dict | None = None

    def region_call(self) -> FlexCall:
        f = self.site.flex
        return FlexCall(
            *super().region_call(), score_mod=f.score_mod, mask_mod=f.mask_mod, tables=f.tables, extras=f.extras,
            score_buffers=f.score_buffers, mask_buffers=f.mask_buffers,
        )  # fmt: skip

    def region_kwargs(self) -> dict:
        kwargs = super().region_kwargs()
        del kwargs["causal"], kwargs["kernel"]
        return dict(kwargs, kernel_options=self.kernel_options, block_size=self.block_size, masked=self.masked)

    def prepare_rewrite(self) -> None:
        """The region calls the global mask_mod itself: strip shard_block_mask's marker from the traced graph."""
        strip_marker(self.site.node.graph.owning_module, self.site.flex.mask_mod)

    def block_count(self) -> int:
        return 1  # one flex_attention call a rank
