"""The fix the sdpa planner names for an explicit attn_mask, when the refused call comes from a library cpcompile
integrates with (Hugging Face: read off the node's recorded stack; nothing here imports the library)."""

from __future__ import annotations

import torch.fx

_HF_SDPA = "transformers/integrations/sdpa_attention.py"
_HF_CPCOMPILE = "cpcompile/integrations/hf.py"


def mask_fix(node: torch.fx.Node) -> str | None:
    """The fix for an explicit attn_mask that Hugging Face built, or None when the call is not HF's."""
    trace = (node.meta.get("stack_trace") or "").replace("\\", "/")
    if _HF_SDPA in trace:
        return (
            'use attn_implementation="cpcompile" (registered by `import cpcompile`): under torch.compile HF\'s '
            '"sdpa" builds a 4-D mask whenever use_cache=False (training, gradient checkpointing), because its '
            "packed-sequence check on position_ids cannot be skipped while tracing; cpcompile's implementation "
            "hands the causal/sliding-window pattern to the CP region instead"
        )
    if _HF_CPCOMPILE in trace:
        return (
            "this model's mask pattern is one cpcompile cannot shard (HF built its 4-D mask for chunked attention, "
            "image-token overlays or a custom mask function); cpcompile runs causal, bidirectional and "
            "sliding-window attention: train this model without CP"
        )
    return None
