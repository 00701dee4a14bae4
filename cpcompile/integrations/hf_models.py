"""What attn_implementation="cpcompile" prepares on a Hugging Face model when it is built (`PreTrainedModel.post_init`)
or switched to it (`set_attn_implementation`), so that it compiles under CP with no other call. Installed by
hf.register() (when transformers loads), once.

- **Hybrids' token mixers** (mixers/hf.py): the torch fallbacks its modeling modules call (`causal_conv1d_fn`,
  `torch_chunk_gated_delta_rule`, `mamba2_chunk_scan`, `mamba_selective_scan`) declared with hf_token_mixers'
  defaults (comm="a2a"); a function declared already keeps its comm (`cpcompile.hf_token_mixers(model,
  comm="state")` still chooses state passing). Before, a hybrid was refused at its conv1d until the user found
  hf_token_mixers. Process-wide, like every declaration: without CP the declared functions are the fallbacks
  themselves, so any model of those modeling modules in the process runs the torch fallback, not a kernel package.
- **Output-capturing hooks**: transformers records router logits, hidden states and attentions through forward
  hooks that a model decorated with `capture_outputs` installs on its first call asking for one of them
  (`output_router_logits=True`: a MoE's aux loss), under a `threading.Lock`, which Dynamo cannot enter ("Unsupported
  context manager: lock", with or without cpcompile). They are installed here instead, when the model is built,
  exactly as that first call would (transformers' own `maybe_install_capturing_hooks`, on the outermost decorated
  model: a decorated model built inside another one gets them from the outer one's install, as it would have),
  so the compiled call finds them in place. An inactive hook returns at once; eagerly it costs a Python call per
  hooked module.
- **MoE aux loss** (hf_moe.py): the modeling modules' `load_balancing_loss_func` with the experts' load counted
  over the CP group.
"""

from __future__ import annotations

import functools

import torch.nn as nn

from ..mixers.hf import hf_default_mixers
from . import hf_moe

NAME = "cpcompile"
"""The attention implementation's name: `attn_implementation="cpcompile"` (hf.py registers it)."""

_MARK = "_cpcompile_prepared"
_HOOKS = "_cpcompile_capture_hooks"
"""On a model whose output-capturing hooks cpcompile installed: [(module, hook id)], to take them back if an outer
decorated model is built around it."""


def uses_cpcompile(model: nn.Module) -> bool:
    """Whether this (sub)model's config asks for attn_implementation="cpcompile"."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME


def _capture_code():
    """The code object of transformers' capture_outputs wrapper (every decorated forward shares it)."""
    from transformers.utils.output_capturing import capture_outputs

    return capture_outputs(lambda self: None).__code__


def _captures(model: nn.Module, code) -> bool:
    """Whether `model`'s class forward is decorated with capture_outputs (anywhere in its decorator chain)."""
    fn = type(model).forward
    for _ in range(16):
        if getattr(fn, "__code__", None) is code:
            return True
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    return False


def _hook_ids(model: nn.Module) -> set[tuple[int, int]]:
    return {(id(m), k) for m in model.modules() for k in m._forward_hooks}


def _install_hooks(model: nn.Module) -> None:
    """transformers' maybe_install_capturing_hooks on `model` (decorated), after taking back what cpcompile installed
    on decorated models inside it: transformers' install on the outer model installs theirs again (one hook each)."""
    from transformers.modeling_utils import PreTrainedModel
    from transformers.utils.output_capturing import maybe_install_capturing_hooks

    if getattr(model, "_output_capturing_hooks_installed", False):
        return
    for inner in model.modules():
        if inner is not model and isinstance(inner, PreTrainedModel) and _HOOKS in inner.__dict__:
            modules = {id(m): m for m in inner.modules()}
            for module_id, key in inner.__dict__.pop(_HOOKS):
                modules[module_id]._forward_hooks.pop(key, None)
            inner._output_capturing_hooks_installed = False
    before = _hook_ids(model)
    maybe_install_capturing_hooks(model)
    modules = {id(m): m for m in model.modules()}
    added = [(module_id, key) for module_id, key in _hook_ids(model) - before if module_id in modules]
    model.__dict__[_HOOKS] = added


def prepare(model: nn.Module) -> None:
    """Make a "cpcompile" model (a PreTrainedModel) ready to compile under CP (see the module doc)."""
    hf_default_mixers(model)
    hf_moe.replace_aux_loss(model)
    if _captures(model, _capture_code()):
        _install_hooks(model)


def install() -> None:
    """Wrap PreTrainedModel.post_init and set_attn_implementation (idempotent)."""
    from transformers.modeling_utils import PreTrainedModel

    if getattr(PreTrainedModel.post_init, _MARK, False):
        return
    post_init, set_attn = PreTrainedModel.post_init, PreTrainedModel.set_attn_implementation

    @functools.wraps(post_init)
    def post_init_then_prepare(self, *args, **kwargs):
        out = post_init(self, *args, **kwargs)
        if uses_cpcompile(self):
            prepare(self)
        return out

    @functools.wraps(set_attn)
    def set_attn_then_prepare(self, *args, **kwargs):
        out = set_attn(self, *args, **kwargs)
        for inner in reversed(list(self.modules())):  # inner models first, as post_init runs
            if isinstance(inner, PreTrainedModel) and uses_cpcompile(inner):
                prepare(inner)
        return out

    setattr(post_init_then_prepare, _MARK, True)
    PreTrainedModel.post_init = post_init_then_prepare
    PreTrainedModel.set_attn_implementation = set_attn_then_prepare
