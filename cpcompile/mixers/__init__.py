"""Token mixers under CP: head-local (channel-local) layers that mix tokens (short causal convs, linear-attention
and SSM scans) run head-parallel in an all-to-all region.

`token_mixer` (declare.py) marks a module or function; the pass step `rewrite_mixers` (rewrite.py) plans
(plan.py) and rewrites each declared call into `mixer_region` (region.py), whose all-to-alls (exchange.py) trade
the sequence for heads and back; or, declared with comm="state" (flat or zigzag), plans (plan_state.py) and rewrites
it into `halo_region` / `state_region` (state_region.py), which pass a conv's edge tokens and a linear
recurrence's chunk transitions along the chunks in sequence order (chain.py: which rank holds the chunk before;
passing.py: the collectives; documents.py: packed documents under thd, each chunk's offsets and the document
carried into and out of it). cost.py: both comms' bytes, for explain(). Under zigzag, relayout_plan.py runs runs of
mixers on flat chunks between two relayouts (relayout.py: one all-to-all) where backend(mixer_layout=) asks.
"""

from .declare import MIXERS, MixerSpec, StateArgs, is_mixer_call, mixer_call, token_mixer
from .hf import HF_MIXERS, hf_default_mixers, hf_token_mixers, restore_hf_mixers
from .plan import MixerPlan, plan_mixer
from .plan_state import StatePlan, plan_state
from .region import mixer_region
from .rewrite import TOKEN_REGION, find_mixers, rewrite_mixers
from .state_region import halo_region, state_region

__all__ = [
    "HF_MIXERS",
    "MIXERS",
    "TOKEN_REGION",
    "MixerPlan",
    "MixerSpec",
    "StateArgs",
    "StatePlan",
    "find_mixers",
    "halo_region",
    "hf_default_mixers",
    "hf_token_mixers",
    "is_mixer_call",
    "mixer_call",
    "mixer_region",
    "plan_mixer",
    "plan_state",
    "restore_hf_mixers",
    "rewrite_mixers",
    "state_region",
    "token_mixer",
]
