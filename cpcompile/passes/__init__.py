"""The CP pass: find attention sites, plan them, rewrite them into CP regions."""

from .match import AttentionSite, find_attention_sites
from .plan import COMMS, CPConfig, CPPlan, plan_site
from .rewrite import rewrite_graph

__all__ = ["COMMS", "AttentionSite", "CPConfig", "CPPlan", "find_attention_sites", "plan_site", "rewrite_graph"]
