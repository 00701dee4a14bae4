"""Token mixers under CP: head-local (channel-local) layers that mix tokens (short causal convs, linear-attention
and SSM scans) run head-parallel in an all-to-all region.

`token_mixer` (declare.py) marks a module or function; the pass step `rewrite_mixers` (rewrite.py) plans
(plan.py) and rewrites each declared call into `mixer_region` (region.py), whose all-to-alls (exchange.py) trade
the sequence for heads and back.
"""

from .declare import MIXERS, MixerSpec, is_mixer_call, mixer_call, token_mixer
from .hf import HF_MIXERS, hf_token_mixers
from .plan import MixerPlan, plan_mixer
from .region import mixer_region
from .rewrite import TOKEN_REGION, find_mixers, rewrite_mixers

__all__ = [
    "HF_MIXERS",
    "MIXERS",
    "TOKEN_REGION",
    "MixerPlan",
    "MixerSpec",
    "find_mixers",
    "hf_token_mixers",
    "is_mixer_call",
    "mixer_call",
    "mixer_region",
    "plan_mixer",
    "rewrite_mixers",
    "token_mixer",
]
