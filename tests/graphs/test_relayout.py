"""A layout per layer kind (backend(mixer_layout=...), cpcompile/mixers/relayout_plan.py) on a fake process group:
a run of token mixers between two relayouts (zigzag -> flat before it, flat -> zigzag after), the attention on
zigzag; the collectives each way; the auto choice on either side of the bytes' break-even; the refusals."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline

import cpcompile
from cpcompile.errors import CPCompileError
from cpcompile.mixers.relayout import relayout
from tests.graphs.test_state_passing import ConvScan, _collectives, _inputs
from tests.support.errors import cp_error
from tests.support.fake_pg import capture_graphs, fake_group, normalize_gm
from tests.support.gdn import GDNLayer
from tests.support.graphs import on_snapshot_torch
from tests.support.hybrid import AttentionBlock


class TwoLinearOneAttention(nn.Module):
    """Two GDN layers (a run of four mixers: conv, scan, conv, scan) and an attention block: (B, L, 16) -> same."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([GDNLayer(16, 2, 4, 3), GDNLayer(16, 2, 4, 3), AttentionBlock(16, 2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _calls(gm) -> str:
    """The rewritten graph's region and relayout calls (the rest is the layers' token-local code)."""
    code = re.sub(r"key = \d+", "key = K", normalize_gm(gm.print_readable(False)))
    keep = [line for line in code.splitlines() if re.search(r"relayout|_region\(|_attention\(|return", line)]
    return "\n".join(line.strip() for line in keep) + "\n"


def test_a_run_of_mixers_runs_flat_between_two_relayouts():
    """10 tokens a rank (a size no other dim has). The relayout to flat comes before the first layer (x, 16 fp32
    a token row), the one back after the second layer's residual add, before the attention: one pair for the four
    mixers, whose regions run flat (their calls name no layout); the attention stays zigzag."""
    torch._dynamo.reset()
    x = torch.randn(1, 10, 16, requires_grad=True)
    with fake_group(1, 2):
        be = cpcompile.backend(strategy="zigzag", inner="eager", mixer_layout="flat")
        graphs = capture_graphs(TwoLinearOneAttention(), be, x)
    if on_snapshot_torch():
        assert_expected_inline(
            _calls(graphs["rewritten"]),
            """\
relayout = cpcompile_mixers_relayout_relayout(l_x_, seq_dims = (1,), src = 'zigzag', dst = 'flat', group_name = '0', rank = 1, world = 2)
getitem_19: "f32[1, 10, 16]" = relayout[0]
halo_region: "f32[1, 10, 22]" = cpcompile_mixers_state_region_halo_region(l_self_modules_layers_modules_0_modules_conv_parameters_weight_, l_self_modules_layers_modules_0_modules_conv_parameters_bias_, qkv, key = K, call_kwargs = {}, context = 3, group_name = '0', rank = 1, world = 2)
state_region = cpcompile_mixers_state_region_state_region(key = K, call_kwargs = {'query': q_1, 'key': k_1, 'value': value, 'g': g, 'beta': value_1}, key_dim = 4, state_dtype = torch.float32, group_name = '0', rank = 1, world = 2)
halo_region_1: "f32[1, 10, 22]" = cpcompile_mixers_state_region_halo_region(l_self_modules_layers_modules_1_modules_conv_parameters_weight_, l_self_modules_layers_modules_1_modules_conv_parameters_bias_, qkv_1, key = K, call_kwargs = {}, context = 3, group_name = '0', rank = 1, world = 2)
state_region_1 = cpcompile_mixers_state_region_state_region(key = K, call_kwargs = {'query': q_3, 'key': k_3, 'value': value_2, 'g': g_1, 'beta': value_3}, key_dim = 4, state_dtype = torch.float32, group_name = '0', rank = 1, world = 2)
relayout_1 = cpcompile_mixers_relayout_relayout(x_1, seq_dims = (1,), src = 'flat', dst = 'zigzag', group_name = '0', rank = 1, world = 2)
getitem_20: "f32[1, 10, 16]" = relayout_1[0]
all_gather_attention: "f32[1, 2, 10, 8]" = cpcompile_comms_all_gather_dense_all_gather_attention(q_4, k_4, v_2, layout = 'zigzag', causal = True, scale = 0.35355339059327373, kernel = 'cpu_flash', group_name = '0', rank = 1, world = 2)
return (x_2,)
""",
        )
    relayouts = [n for n in graphs["rewritten"].graph.nodes if n.target is relayout]
    assert [(n.kwargs["src"], n.kwargs["dst"]) for n in relayouts] == [("zigzag", "flat"), ("flat", "zigzag")]
    # (all-to-alls, all-gathers, reduce-scatters): the two relayouts and the flat convs' one shift each; the flat
    # scans' transitions gathered; the attention's K/V gathered (its backward: reduce-scattered). Backward the same
    # all-to-alls (the relayouts' inverse permutations, the halos' gradients)
    assert _collectives(graphs["fw"]) == (4, 3, 0), _collectives(graphs["fw"])
    assert _collectives(graphs["bw"]) == (4, 0, 3), _collectives(graphs["bw"])


def _run_line(seq: int) -> str:
    torch._dynamo.reset()
    inputs = (t.repeat(1, seq // 8, *[1] * (t.dim() - 2))[:, :seq] for t in _inputs())
    report = cpcompile.explain(ConvScan(), *inputs, strategy="zigzag", world=4, mixer_layout="auto")
    assert not report.refusals, report.refusals
    return next(n for n in report.notes if "CausalConv:" in n)


@pytest.mark.parametrize("seq", [24, 64])
def test_auto_follows_the_bytes(seq):
    """ConvScan at cp 4, zigzag: its mixers receive 2112 bytes a rank on zigzag chunks, 1056 on flat ones, whatever
    the length; the relayouts receive 144 bytes a token row (x, g and beta there: 96 + 8 + 8; the output back: 32)
    for L token rows (cp 4: ranks 1 and 2 exchange every chunk). So flat between relayouts below L = 7.3: at 6
    tokens a rank (1920 bytes) it is chosen, at 16 (3360) zigzag stays."""
    line = _run_line(seq)
    local = seq // 4
    flat = 1056 + 144 * local
    verdict = "flat between relayouts" if flat < 2112 else "zigzag"
    assert (verdict == "zigzag") == (seq == 64), (seq, flat)
    assert (
        f"layout {verdict} (run of 2 mixer call(s) from CausalConv: 2112 bytes received a rank per forward call on "
        f"zigzag chunks, {flat} on flat chunks with the relayouts ({144 * local} of it); mixer_layout='auto')"
    ) in line, line


def test_auto_inserts_the_relayouts_it_chooses():
    torch._dynamo.reset()
    inputs = [t[:, :6].detach().clone().requires_grad_() for t in _inputs()]
    with fake_group(0, 4):
        graphs = capture_graphs(ConvScan(), cpcompile.backend(strategy="zigzag", inner="eager", mixer_layout="auto"),
                                *inputs)  # fmt: skip
    relayouts = [n for n in graphs["rewritten"].graph.nodes if n.target is relayout]
    assert [[a.name for a in n.args] for n in relayouts] == [["l_x_", "l_g_", "l_beta_"], ["getitem_3"]], relayouts


def test_bad_values_are_refused():
    with pytest.raises(CPCompileError, match=r"unknown mixer_layout 'zigzag'. Fix: use one of \['same', 'auto'"):
        cpcompile.backend(strategy="zigzag", mixer_layout="zigzag")
    with pytest.raises(CPCompileError, match="mixer_layout='flat' with strategy='thd': a relayout of packed"):
        cpcompile.backend(strategy="thd", mixer_layout="flat")
    with pytest.raises(CPCompileError, match="unknown mixer_layout"):
        cpcompile.explain(ConvScan(), *_inputs(), mixer_layout="never")


def test_flat_refuses_a_run_it_cannot_relayout():
    """24 tokens a rank: x (1, 24, 24) holds two dims of the local length, so which one is the sequence is not
    clear and no cut around the run may relayout it: mixer_layout="flat" says so, naming the mixer."""
    torch._dynamo.reset()
    inputs = [t.repeat(1, 3, *[1] * (t.dim() - 2)) for t in _inputs()]  # 24 tokens
    with fake_group(0, 2):
        be = cpcompile.backend(strategy="zigzag", inner="eager", mixer_layout="flat")
        with pytest.raises(Exception) as e:
            torch.compile(ConvScan(), backend=be, fullgraph=True)(*inputs)
    msg = str(cp_error(e))
    assert "cpcompile cannot run token mixer 'mixer_call' at " in msg, msg
    assert "on flat chunks (mixer_layout='flat'): every cut around it crosses a tensor without one seq dim" in msg
    assert "Fix: use mixer_layout='auto' or 'same'" in msg, msg


class WritesBetween(ConvScan):
    """ConvScan with an in-place write between its two mixers."""

    def forward(self, x, g, beta):
        b, n, _ = x.shape
        y = self.conv(x)
        y.mul_(0.5)
        q, k, v = y.view(b, n, 3, self.heads, self.dim).unbind(2)
        return self.scan(q, k, v, g, beta)[0]


def test_an_in_place_op_ends_a_run():
    """An in-place write between the conv and the scan: on a flat copy it would not write what code outside a run
    reads, so the mixers are two runs, each between its own relayouts."""
    torch._dynamo.reset()
    inputs = [t.repeat(1, 4, *[1] * (t.dim() - 2))[:, :24] for t in _inputs()]  # 6 tokens a rank at cp 4
    report = cpcompile.explain(WritesBetween(), *inputs, strategy="zigzag", world=4, mixer_layout="flat")
    assert not report.refusals, report.refusals
    for name in ("CausalConv", "gated_delta_rule"):
        line = next(n for n in report.notes if f"{name}:" in n)
        assert f"layout flat between relayouts (run of 1 mixer call(s) from {name}:" in line, line
