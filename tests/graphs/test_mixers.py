"""Declared token mixers (cpcompile.token_mixer) on a fake process group: the rewritten graph, the all-to-alls
each way, and the refusals (before any collective). A declaration's key counts declarations in the process, so
the snapshot shows it as K."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import assert_expected_inline

import cpcompile
from tests.support.errors import cp_error
from tests.support.fake_pg import capture_graphs, fake_group, normalize_gm
from tests.support.graphs import on_snapshot_torch
from tests.support.hybrid import CausalConv, GatedRecurrence

_c10d = torch.ops._c10d_functional


class ConvThenAttention(nn.Module):
    """A declared depthwise causal conv on (B, L, C) feeding causal SDPA (C = heads * head_dim)."""

    def __init__(self, channels: int = 8, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.conv = cpcompile.token_mixer(CausalConv(channels), heads_dim=2)

    def forward(self, x):
        b, n, c = x.shape
        y = self.conv(x).view(b, n, self.heads, c // self.heads).transpose(1, 2)
        return F.scaled_dot_product_attention(y, y, y, is_causal=True)


def _x(seq=8, channels=8):
    return torch.randn(1, seq, channels, generator=torch.Generator().manual_seed(0), requires_grad=True)


def _all_to_alls(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is _c10d.all_to_all_single.default)


def test_rewritten_graph_and_collectives():
    torch._dynamo.reset()
    with fake_group(1, 4):
        be = cpcompile.backend(strategy="zigzag", comm="all_gather", inner="eager")
        graphs = capture_graphs(ConvThenAttention(), be, _x())
    if on_snapshot_torch():
        assert_expected_inline(
            re.sub(r"key = \d+", "key = K", normalize_gm(graphs["rewritten"].print_readable(False))),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[1, 8, 8]", L_self_modules_conv_parameters_weight_: "f32[8, 1, 4]", L_self_modules_conv_parameters_bias_: "f32[8]"):
        l_x_ = L_x_
        l_self_modules_conv_parameters_weight_ = L_self_modules_conv_parameters_weight_
        l_self_modules_conv_parameters_bias_ = L_self_modules_conv_parameters_bias_
        mixer_region: "f32[1, 8, 8]" = cpcompile_mixers_region_mixer_region(l_self_modules_conv_parameters_weight_, l_self_modules_conv_parameters_bias_, l_x_, key = K, weight_dims = (0, 0), call_kwargs = {}, layout = 'zigzag', group_name = '0', rank = 1, world = 4)
        view: "f32[1, 8, 4, 2]" = mixer_region.view(1, 8, 4, 2)
        y: "f32[1, 4, 8, 2]" = view.transpose(1, 2)
        all_gather_attention: "f32[1, 4, 8, 2]" = cpcompile_comms_all_gather_dense_all_gather_attention(y, y, y, layout = 'zigzag', causal = True, scale = 0.7071067811865475, kernel = 'cpu_flash', group_name = '0', rank = 1, world = 4)
        return (all_gather_attention,)
""",
        )
    assert (_all_to_alls(graphs["fw"]), _all_to_alls(graphs["bw"])) == (2, 2)  # tokens -> heads -> tokens


def test_a_scan_s_four_inputs_travel_in_one_all_to_all():
    """q, k, v (B, L, H, D) and the decay logits (B, L, H) are packed side by side per token: one all-to-all in,
    one back, each way (zigzag: plus the reorder into global order and back)."""
    torch._dynamo.reset()
    scan = cpcompile.token_mixer(GatedRecurrence(4, 8), heads_dim=2)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 4, 8, generator=g, requires_grad=True) for _ in range(3))
    a = torch.randn(1, 8, 4, generator=g, requires_grad=True)
    with fake_group(1, 4):
        graphs = capture_graphs(scan, cpcompile.backend(strategy="zigzag", inner="eager"), q, k, v, a)
    assert (_all_to_alls(graphs["fw"]), _all_to_alls(graphs["bw"])) == (2, 2)


def _compile_error(model, *inputs, world=4, strategy="zigzag") -> str:
    torch._dynamo.reset()
    with fake_group(0, world):
        be = cpcompile.backend(strategy=strategy, inner="eager")
        with pytest.raises(Exception) as e:
            torch.compile(model, backend=be, fullgraph=True)(*inputs)
    return str(cp_error(e))


def test_heads_that_do_not_split_are_refused():
    msg = _compile_error(ConvThenAttention(channels=6, heads=2), _x(seq=6, channels=6), world=4)
    assert "6 heads (channels) on dim 2, which do not split over 4 CP ranks" in msg, msg
    assert "token mixer 'mixer_call' at " in msg and "test_mixers.py" in msg and "CausalConv" in msg, msg


class ConstantGroups(nn.Module):
    """Not head-count polymorphic: groups from the constructor, so it cannot run on channels/cp."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.channels = channels
        self.weight = nn.Parameter(torch.randn(channels, 1, 3))

    def forward(self, x):
        y = F.conv1d(x.transpose(1, 2), self.weight, padding=2, groups=self.channels)
        return y[..., : x.shape[1]].transpose(1, 2)


class Wrap(nn.Module):
    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.mixer = mixer

    def forward(self, x):
        y = self.mixer(x)
        q = y.view(1, y.shape[1], 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_a_mixer_that_reads_constant_head_counts_is_refused():
    msg = _compile_error(Wrap(cpcompile.token_mixer(ConstantGroups(), heads_dim=2)), _x())
    assert "fails on the whole sequence for 1/4 of its heads" in msg, msg
    assert "groups=x.shape[1]" in msg, msg


def test_packed_layouts_are_refused():
    mixer = cpcompile.token_mixer(CausalConv(8), heads_dim=2)  # no attention: the mixer alone under thd
    msg = _compile_error(lambda x: mixer(x) * 2, _x(), strategy="thd")
    assert "chunk layouts ['flat', 'zigzag'] only, not 'thd'" in msg, msg
    assert "declare it with comm='state' and documents='cu_seqlens' (state passing)" in msg, msg


def test_an_undeclared_conv_is_refused_naming_token_mixer():
    msg = _compile_error(Wrap(CausalConv(8)), _x())
    assert "conv" in msg and "cpcompile.token_mixer(module_or_fn, heads_dim=...)" in msg, msg


def test_without_cp_the_mixer_is_the_module():
    torch.manual_seed(0)
    plain = GatedRecurrence(4, 8)
    declared = cpcompile.token_mixer(GatedRecurrence(4, 8), heads_dim=2)
    declared.load_state_dict(plain.state_dict())
    q, k, v = (torch.randn(2, 12, 4, 8) for _ in range(3))
    a = torch.randn(2, 12, 4)
    torch.testing.assert_close(declared(q, k, v, a), plain(q, k, v, a), rtol=0, atol=0)


def test_explain_counts_the_mixers_and_reports_their_refusals():
    """explain() rewrites mixers like the pass: a note per graph; a mixer that cannot split is a refusal."""
    from tests.support.hybrid import HybridModel

    torch._dynamo.reset()
    ids = torch.randint(0, 32, (1, 16))
    report = cpcompile.explain(HybridModel(), ids, strategy="zigzag", world=4)
    assert not report.refusals, report.refusals
    assert any(
        "4 token mixer call(s) run head-parallel over a2a (CausalConv, GatedRecurrence)" in n for n in report.notes
    ), report.notes
    refused = cpcompile.explain(HybridModel(), ids, strategy="zigzag", world=8)  # 4 heads over 8 ranks
    assert any("do not split over 8 CP ranks" in r.message for r in refused.refusals), refused.refusals


def test_a_module_is_declared_once():
    conv = cpcompile.token_mixer(CausalConv(8), heads_dim=2)
    with pytest.raises(ValueError, match="declared already"):
        cpcompile.token_mixer(conv, heads_dim=2)


def _shared_scan(u: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A Mamba1-shaped mixer: u (B, D, L) per channel, gate (B, N, L) read by every channel (no channel dim)."""
    return torch.cumsum(u * gate.sum(1, keepdim=True) * weight[:, None], dim=2)


def test_shared_inputs_are_gathered_whole_and_their_gradients_summed():
    """A shared input reaches every rank whole (one all-gather, no all-to-all), and backward sums its gradient over
    the ranks back to its tokens' owners (one reduce-scatter); the channel inputs go by all-to-all as before."""
    torch._dynamo.reset()
    scan = cpcompile.token_mixer(
        _shared_scan, heads_dim=1, seq_dim=2, weight_dims={"weight": 0}, shared_inputs=("gate",)
    )
    g = torch.Generator().manual_seed(0)
    u = torch.randn(1, 8, 8, generator=g, requires_grad=True)
    gate = torch.randn(1, 3, 8, generator=g, requires_grad=True)
    weight = torch.randn(8, generator=g, requires_grad=True)
    with fake_group(1, 4):
        graphs = capture_graphs(scan, cpcompile.backend(strategy="zigzag", inner="eager"), u, gate, weight)
    count = lambda gm, op: sum(1 for n in gm.graph.nodes if n.target is op)  # noqa: E731
    fw, bw = graphs["fw"], graphs["bw"]
    assert (count(fw, _c10d.all_gather_into_tensor.default), _all_to_alls(fw)) == (1, 2)
    assert (count(bw, _c10d.reduce_scatter_tensor.default), _all_to_alls(bw)) == (1, 2)


def test_shared_inputs_are_a_function_s_token_arguments():
    with pytest.raises(ValueError, match="shared_inputs name a function's arguments"):
        cpcompile.token_mixer(CausalConv(8), heads_dim=2, shared_inputs=("x",))
    with pytest.raises(ValueError, match=r"\['weight'\] are not arguments .* \(shared_inputs: token arguments"):
        cpcompile.token_mixer(
            _shared_scan, heads_dim=1, seq_dim=2, weight_dims={"weight": 0}, shared_inputs=("weight",)
        )
    with pytest.raises(ValueError, match=r"\['nope'\] are not arguments"):
        cpcompile.token_mixer(_shared_scan, heads_dim=1, seq_dim=2, shared_inputs=("nope",))


class MixesChannels(CausalConv):
    """A causal conv that also adds every channel's mean to each: it mixes heads, so it is not head-local."""

    def forward(self, x):
        y = super().forward(x)
        return y + y.mean(-1, keepdim=True)


class ScanThenAttention(nn.Module):
    """A declared GatedRecurrence over (B, L, H, D) q/k/v feeding causal SDPA."""

    def __init__(self, scan: nn.Module) -> None:
        super().__init__()
        self.scan = scan

    def forward(self, q, k, v, a):
        y = self.scan(q, k, v, a).transpose(1, 2)
        return F.scaled_dot_product_attention(y, y, y, is_causal=True)


def _qkva(seq=8, heads=4, dim=4):
    g = torch.Generator().manual_seed(0)
    return (*(torch.randn(1, seq, heads, dim, generator=g) for _ in range(3)), torch.randn(1, seq, heads, generator=g))


def test_a_mixer_that_mixes_heads_declared_head_local_is_refused():
    """The declaration is checked against the mixer's code when the graph compiles (mixers/head_check.py): the
    mixer on each rank's block of heads must give what it gives on all heads. A conv that mixes its channels
    (silent before, error 1.79 against one process in a model) and a function declared with the wrong heads_dim
    (the dim it normalises over) are refused before any collective; declared right, the function compiles."""
    msg = _compile_error(Wrap(cpcompile.token_mixer(MixesChannels(8), heads_dim=2)), _x())
    assert "MixesChannels (declared with cpcompile.token_mixer) is not head-local as declared (heads_dim=2" in msg
    assert "run on each of the 4 blocks of heads the a2a region gives a rank, its outputs differ" in msg, msg
    assert "token mixer 'y' at " in msg and "declare it with comm='state'" in msg, msg
    wrong = cpcompile.token_mixer(_normalized_cumsum, heads_dim=3)
    msg = _compile_error(lambda x: F.scaled_dot_product_attention(*[wrong(x).transpose(1, 2)] * 3), _qkva()[0])
    assert "_normalized_cumsum (declared with cpcompile.token_mixer) is not head-local as declared (heads_dim=3" in msg
    right = cpcompile.token_mixer(_normalized_cumsum, heads_dim=2)
    torch._dynamo.reset()
    with fake_group(0, 4):
        be = cpcompile.backend(strategy="zigzag", inner="eager")
        torch.compile(lambda x: right(x) * 2, backend=be, fullgraph=True)(_qkva()[0])


def _normalized_cumsum(x):
    """(B, L, H, D): a running sum over tokens, normalised over each head's D values: head-local along H (dim 2),
    not along D (dim 3)."""
    return F.normalize(torch.cumsum(x, dim=1), dim=-1)


def test_a_shared_weight_split_with_the_heads_is_refused():
    """A module's parameter whose dim 0 equals a head count splits with the heads unless declared shared: the
    recurrence's norm (Dv,) with Dv == H is shared by every head, so the default split is refused, naming
    weight_dims; declared shared, the same mixer compiles."""
    msg = _compile_error(ScanThenAttention(cpcompile.token_mixer(GatedRecurrence(4, 4), heads_dim=2)), *_qkva())
    assert "is not head-local as declared (heads_dim=2, weights split with the heads: {'A_log': 0, 'norm': 0})" in msg
    assert "weight_dims={name: None} for weights every head shares" in msg, msg
    shared = cpcompile.token_mixer(GatedRecurrence(4, 4), heads_dim=2, weight_dims={"norm": None})
    torch._dynamo.reset()
    with fake_group(0, 4):
        be = cpcompile.backend(strategy="zigzag", inner="eager")
        torch.compile(ScanThenAttention(shared), backend=be, fullgraph=True)(*_qkva())
    assert len(be.plans) == 1
