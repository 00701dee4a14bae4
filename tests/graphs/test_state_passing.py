"""State passing (token_mixer(comm="state")) on a fake process group: the rewritten graph, the collectives each way
on every rank (rank 0 reads no earlier state but joins every collective), and the refusals (before any
collective). A declaration's key counts declarations in the process, so the snapshot shows it as K."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline

import cpcompile
from tests.support.errors import cp_error
from tests.support.fake_pg import capture_graphs, fake_group, normalize_gm
from tests.support.gdn import PackedCausalConv, gated_delta_rule
from tests.support.graphs import on_snapshot_torch
from tests.support.hybrid import CausalConv

_c10d = torch.ops._c10d_functional


class ConvScan(nn.Module):
    """A causal conv over q/k/v (a halo of 3 tokens), then the gated delta rule (its state passed)."""

    def __init__(self, heads: int = 2, dim: int = 4, final_state: bool = False) -> None:
        super().__init__()
        self.heads, self.dim, self.final_state = heads, dim, final_state
        context = lambda w: w["weight"].shape[-1] - 1  # noqa: E731
        self.conv = cpcompile.token_mixer(CausalConv(3 * heads * dim), heads_dim=2, comm="state", context=context)
        self.scan = cpcompile.token_mixer(gated_delta_rule, heads_dim=2, comm="state", state=True)

    def forward(self, x, g, beta):
        b, n, _ = x.shape
        q, k, v = self.conv(x).view(b, n, 3, self.heads, self.dim).unbind(2)
        return self.scan(q, k, v, g, beta, output_final_state=self.final_state)[0]


def _inputs(seq=8, heads=2, dim=4):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq, 3 * heads * dim, generator=gen, requires_grad=True)
    g = -torch.rand(1, seq, heads, generator=gen).requires_grad_()
    beta = torch.rand(1, seq, heads, generator=gen).requires_grad_()
    return x, g, beta


def _count(gm, op) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is op)


def _collectives(gm) -> tuple[int, int, int]:
    ops = (_c10d.all_to_all_single.default, _c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default)
    return tuple(_count(gm, op) for op in ops)


def test_rewritten_graph_and_collectives():
    torch._dynamo.reset()
    with fake_group(1, 4):
        graphs = capture_graphs(ConvScan(), cpcompile.backend(strategy="flat", inner="eager"), *_inputs())
    if on_snapshot_torch():
        assert_expected_inline(
            re.sub(r"key = \d+", "key = K", normalize_gm(graphs["rewritten"].print_readable(False))),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[1, 8, 24]", L_self_modules_conv_parameters_weight_: "f32[24, 1, 4]", L_self_modules_conv_parameters_bias_: "f32[24]", L_g_: "f32[1, 8, 2]", L_beta_: "f32[1, 8, 2]"):
        l_x_ = L_x_
        l_self_modules_conv_parameters_weight_ = L_self_modules_conv_parameters_weight_
        l_self_modules_conv_parameters_bias_ = L_self_modules_conv_parameters_bias_
        l_g_ = L_g_
        l_beta_ = L_beta_
        halo_region: "f32[1, 8, 24]" = cpcompile_mixers_state_region_halo_region(l_self_modules_conv_parameters_weight_, l_self_modules_conv_parameters_bias_, l_x_, key = K, call_kwargs = {}, context = 3, group_name = '0', rank = 1, world = 4)
        view: "f32[1, 8, 3, 2, 4]" = halo_region.view(1, 8, 3, 2, 4)
        unbind = view.unbind(2)
        q: "f32[1, 8, 2, 4]" = unbind[0]
        k: "f32[1, 8, 2, 4]" = unbind[1]
        v: "f32[1, 8, 2, 4]" = unbind[2]
        state_region = cpcompile_mixers_state_region_state_region(key = K, call_kwargs = {'query': q, 'key': k, 'value': v, 'g': l_g_, 'beta': l_beta_, 'output_final_state': False}, key_dim = 4, state_dtype = torch.float32, group_name = '0', rank = 1, world = 4)
        getitem_3: "f32[1, 8, 2, 4]" = state_region[0]
        return (getitem_3,)
""",
        )
    # (all-to-alls, all-gathers, reduce-scatters): the conv's halo goes to the next rank (a one-split all-to-all)
    # and its gradient comes back; the scan's chunk transitions are all-gathered, their gradients reduce-scattered
    assert _collectives(graphs["fw"]) == (1, 1, 0)
    assert _collectives(graphs["bw"]) == (1, 0, 1)


@pytest.mark.parametrize("rank", [0, 3])
def test_the_first_and_last_ranks_join_every_collective(rank):
    """Rank 0 reads zeros before its tokens and no earlier state, the last rank's state nobody reads: both still
    send and receive what the others wait for, in the backward too (not moved into the forward)."""
    torch._dynamo.reset()
    with fake_group(rank, 4):
        graphs = capture_graphs(ConvScan(), cpcompile.backend(strategy="flat", inner="eager"), *_inputs())
    assert (_collectives(graphs["fw"]), _collectives(graphs["bw"])) == ((1, 1, 0), (1, 0, 1))


@pytest.mark.parametrize("rank,world,shifts", [(0, 4, 2), (3, 4, 2), (1, 2, 1)])
def test_zigzag_passes_state_along_the_chunks(rank, world, shifts):
    """Zigzag (rank r: chunks r and 2cp-1-r): the conv's tails go to the next rank (chunk r's halo is rank r-1's
    first chunk) and to the previous one (chunk 2cp-1-r's is rank r+1's second chunk): two shifts each way, one at
    cp 2 (both are offset 1 there); the transitions of both chunks of every rank in ONE all-gather, their gradients
    in one reduce-scatter. Rank 0's first chunk and the last rank's second-chunk halo (its own first chunk) read
    nothing received, yet join every collective. The region call names the layout; flat's does not."""
    torch._dynamo.reset()
    with fake_group(rank, world):
        graphs = capture_graphs(ConvScan(), cpcompile.backend(strategy="zigzag", inner="eager"), *_inputs())
    assert (_collectives(graphs["fw"]), _collectives(graphs["bw"])) == ((shifts, 1, 0), (shifts, 0, 1))
    calls = [n for n in graphs["rewritten"].graph.nodes if n.op == "call_function" and "region" in n.name]
    assert [n.kwargs["layout"] for n in calls] == ["zigzag", "zigzag"], calls
    assert all(n.kwargs["rank"] == rank and n.kwargs["world"] == world for n in calls), calls


def _compile_error(model, *inputs, world=4, strategy="flat") -> str:
    torch._dynamo.reset()
    with fake_group(0, world):
        be = cpcompile.backend(strategy=strategy, inner="eager")
        with pytest.raises(Exception) as e:
            torch.compile(model, backend=be, fullgraph=True)(*inputs)
    return str(cp_error(e))


class PackedConvScan(nn.Module):
    """ConvScan over packed documents: both mixers take fla's cu_seqlens and are declared to reset at them."""

    def __init__(self, heads: int = 2, dim: int = 4) -> None:
        super().__init__()
        self.heads, self.dim = heads, dim
        context = lambda w: w["weight"].shape[-1] - 1  # noqa: E731
        conv = PackedCausalConv(3 * heads * dim)
        self.conv = cpcompile.token_mixer(conv, heads_dim=2, comm="state", context=context, documents="cu_seqlens")
        self.scan = cpcompile.token_mixer(gated_delta_rule, heads_dim=2, comm="state", state=True,
                                          documents="cu_seqlens")  # fmt: skip

    def forward(self, x, g, beta, cu_seqlens):
        b, n, _ = x.shape
        q, k, v = self.conv(x, cu_seqlens=cu_seqlens).view(b, n, 3, self.heads, self.dim).unbind(2)
        return self.scan(q, k, v, g, beta, cu_seqlens=cu_seqlens)[0]


CU = torch.tensor([0, 3, 8, 9, 11, 16], dtype=torch.int32)
"""Documents of a 16-token buffer (4 tokens a rank at cp 4)."""


def _packed_inputs():
    return (*_inputs(seq=4), CU)


def test_packed_documents_pass_state_with_each_chunk_s_offsets():
    """Strategy "thd": the regions take the GLOBAL offsets (`documents='cu_seqlens'`) and run flat's chain of chunks
    (one a rank) with the same collectives as flat (the offsets travel nowhere: every rank holds them whole), plus
    the offsets' run-time check (mixers/checks.py: one small all-gather, before the first region reads them)."""
    torch._dynamo.reset()
    with fake_group(1, 4):
        graphs = capture_graphs(PackedConvScan(), cpcompile.backend(strategy="thd", inner="eager"), *_packed_inputs())
    assert (_collectives(graphs["fw"]), _collectives(graphs["bw"])) == ((1, 2, 0), (1, 0, 1))
    if on_snapshot_torch():
        code = re.sub(r"key = \d+", "key = K", normalize_gm(graphs["rewritten"].print_readable(False)))
        assert_expected_inline(
            code,
            """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[1, 4, 24]", L_self_modules_conv_parameters_weight_: "f32[24, 1, 4]", L_self_modules_conv_parameters_bias_: "f32[24]", L_cu_seqlens_: "i32[6]", L_g_: "f32[1, 4, 2]", L_beta_: "f32[1, 4, 2]"):
        l_x_ = L_x_
        l_self_modules_conv_parameters_weight_ = L_self_modules_conv_parameters_weight_
        l_self_modules_conv_parameters_bias_ = L_self_modules_conv_parameters_bias_
        l_cu_seqlens_ = L_cu_seqlens_
        l_g_ = L_g_
        l_beta_ = L_beta_
        check_packed_metadata: "i32[6]" = cpcompile_regions_guards_check_packed_metadata(l_cu_seqlens_, total = 16, max_doc = None, doc_multiple_per_cp = 0, group_name = '0', world = 4)
        halo_region: "f32[1, 4, 24]" = cpcompile_mixers_state_region_halo_region(l_self_modules_conv_parameters_weight_, l_self_modules_conv_parameters_bias_, l_x_, key = K, call_kwargs = {'cu_seqlens': check_packed_metadata}, context = 3, group_name = '0', rank = 1, world = 4, documents = 'cu_seqlens')
        view: "f32[1, 4, 3, 2, 4]" = halo_region.view(1, 4, 3, 2, 4)
        unbind = view.unbind(2)
        q: "f32[1, 4, 2, 4]" = unbind[0]
        k: "f32[1, 4, 2, 4]" = unbind[1]
        v: "f32[1, 4, 2, 4]" = unbind[2]
        state_region = cpcompile_mixers_state_region_state_region(key = K, call_kwargs = {'query': q, 'key': k, 'value': v, 'g': l_g_, 'beta': l_beta_, 'cu_seqlens': check_packed_metadata}, key_dim = 4, state_dtype = torch.float32, group_name = '0', rank = 1, world = 4, documents = 'cu_seqlens')
        getitem_3: "f32[1, 4, 2, 4]" = state_region[0]
        return (getitem_3,)
""",
        )


def test_explain_under_thd_prints_the_packed_state_passing_bytes():
    """explain(strategy="thd"): the conv receives one 3-token tail of 24 fp32 channels (288 bytes; the offsets are
    not tokens and travel nowhere), the scan 3 other ranks' 1 x 2 x 4 x (4 + 4) fp32 transitions (768); a2a cannot
    run packed documents, so no a2a bytes are compared."""
    torch._dynamo.reset()
    x, g, beta = (t.repeat(1, 4, *[1] * (t.dim() - 2)) for t in _inputs(seq=4))
    report = cpcompile.explain(PackedConvScan(), x, g, beta, CU, strategy="thd", world=4, cu_seqlens=CU, seq_dim=1)
    assert not report.refusals, report.refusals
    for line in (
        "PackedCausalConv: state passing, 288 bytes received a rank per forward call (packed documents from "
        "cu_seqlens=; a2a cannot run them)",
        "gated_delta_rule: state passing, 768 bytes received a rank per forward call (packed documents",
    ):
        assert any(line in n for n in report.notes), report.notes


def test_packed_layouts_that_reorder_documents_are_refused():
    """thd_zigzag (every document in 2cp pieces) and thd_balanced (documents reordered): a rank's tokens are not one
    stretch of the buffer; one CPCompileError naming the node, the layouts that work and what to use."""
    for strategy in ("thd_zigzag", "thd_balanced"):
        msg = _compile_error(PackedConvScan(), *_packed_inputs(), strategy=strategy)
        assert "passes state along chunks in sequence order (comm='state'): strategy 'flat', 'zigzag' or 'thd'" in msg
        assert f"not {strategy!r}, which orders a rank's tokens by document" in msg, msg
        assert "use strategy='thd' for packed documents" in msg and "token mixer 'mixer_call' at " in msg, msg


def test_thd_without_the_documents_offsets_is_refused():
    """Under thd a mixer that is not given the offsets would carry its state across every document start."""
    msg = _compile_error(ConvScan(), *_inputs(), strategy="thd")
    assert "runs under strategy 'thd' (packed documents) without the documents' offsets" in msg, msg
    assert "declare it with token_mixer(..., documents='cu_seqlens')" in msg, msg


def _scan_with_documents(query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
    """The gated delta rule taking fla's `cu_seqlens` in **kwargs and ignoring it, as HF's torch fallback does."""
    return gated_delta_rule(query, key, value, g, beta, initial_state, output_final_state)


class PackedScan(nn.Module):
    """A gated delta rule given packed documents' boundaries (`name`: fla's cu_seqlens, Mamba's seq_idx)."""

    def __init__(self, name: str = "cu_seqlens", documents: str | None = None) -> None:
        super().__init__()
        self.name = name
        fn = gated_delta_rule if documents else _scan_with_documents
        self.scan = cpcompile.token_mixer(fn, heads_dim=2, comm="state", state=True, documents=documents)

    def forward(self, q, k, v, g, beta, bounds):
        return self.scan(q, k, v, g, beta, **{self.name: bounds})[0]


def test_documents_a_mixer_is_not_declared_to_reset_at_are_refused():
    """A mixer given documents' boundaries that its declaration does not say it honours (HF's torch fallbacks
    ignore cu_seqlens), or per-token document ids: refused before any collective, under every strategy."""
    for strategy in ("flat", "thd"):
        msg = _compile_error(
            PackedScan(), *_scan_inputs(8), torch.tensor([0, 3, 8], dtype=torch.int32), strategy=strategy
        )
        assert "is given packed documents' boundaries (cu_seqlens=...) but is not declared to reset at them" in msg
        assert "_scan_with_documents" in msg and "declare it with documents='cu_seqlens'" in msg, msg
        assert "transformers' torch fallbacks take cu_seqlens in **kwargs and ignore it" in msg, msg
    msg = _compile_error(PackedScan("seq_idx"), *_scan_inputs(8), torch.zeros(1, 8, dtype=torch.int32))
    assert "is given packed documents' boundaries (seq_idx=...)" in msg and "(seq_idx=) are not supported" in msg


def test_documents_under_zigzag_chunks_are_refused():
    msg = _compile_error(PackedScan(documents="cu_seqlens"), *_scan_inputs(8), CU, strategy="zigzag")
    assert "is given packed documents (cu_seqlens=) under strategy 'zigzag'" in msg, msg
    assert "use strategy='thd' for packed documents" in msg, msg


def test_documents_over_a_batch_of_rows_are_refused():
    inputs = [t.expand(2, *t.shape[1:]) for t in _scan_inputs(8)]
    msg = _compile_error(PackedScan(documents="cu_seqlens"), *inputs, torch.tensor([0, 3, 8]), strategy="thd")
    assert "is given cu_seqlens= with token tensors of batch [2], not 1" in msg, msg


def test_a_halo_longer_than_a_zigzag_chunk_is_refused():
    msg = _compile_error(ConvScan(), *_inputs(seq=4), strategy="zigzag")  # 2 chunks of 2 tokens, a 3-token halo
    assert "reads context=3 earlier tokens, not an int from 0 to the 2 tokens of each of a rank's 2 chunks" in msg


def test_a_final_state_asked_for_is_refused():
    msg = _compile_error(ConvScan(final_state=True), *_inputs())
    assert "asked for its final state (output_final_state=True)" in msg, msg
    assert "gated_delta_rule" in msg, msg


def test_a_halo_longer_than_a_rank_s_tokens_is_refused():
    msg = _compile_error(ConvScan(), *_inputs(seq=2))  # this rank's 2 tokens, a 3-token halo
    assert "reads context=3 earlier tokens, not an int from 0 to the 2 tokens a rank holds" in msg, msg


def test_declarations_name_what_state_passing_needs():
    with pytest.raises(ValueError, match="comm='state' needs exactly one of context="):
        cpcompile.token_mixer(gated_delta_rule, heads_dim=2, comm="state")
    with pytest.raises(ValueError, match=r"comm='ring'; use one of \['a2a', 'state', 'auto'\]"):
        cpcompile.token_mixer(gated_delta_rule, heads_dim=2, comm="ring")
    with pytest.raises(ValueError, match="hf_token_mixers: comm='ring'"):
        cpcompile.hf_token_mixers(nn.Linear(2, 2), comm="ring")


def test_without_cp_a_state_mixer_is_the_function():
    declared = cpcompile.token_mixer(gated_delta_rule, heads_dim=2, comm="state", state=True)
    q, k, v = (torch.randn(1, 6, 2, 4) for _ in range(3))
    g, beta = -torch.rand(1, 6, 2), torch.rand(1, 6, 2)
    torch.testing.assert_close(declared(q, k, v, g, beta)[0], gated_delta_rule(q, k, v, g, beta)[0], rtol=0, atol=0)


def test_explain_prints_both_comms_bytes():
    """explain(): a line per state-passing mixer with its bytes and a2a's. The conv: 3 tokens of 24 fp32 channels
    (288 bytes) against (3/4 of) its 8 x 24 input and output (1152); the scan: 3 other ranks' 1 x 2 x 4 x (4 + 4)
    fp32 transitions (768) against 3/4 of q, k, v, g, beta and the output (864)."""
    torch._dynamo.reset()
    report = cpcompile.explain(ConvScan(), *(t.repeat(1, 4, *[1] * (t.dim() - 2)) for t in _inputs()), world=4)
    assert not report.refusals, report.refusals
    for line in (
        "CausalConv: state passing, 288 bytes received a rank per forward call (a2a would receive 1152)",
        "gated_delta_rule: state passing, 768 bytes received a rank per forward call (a2a would receive 864)",
    ):
        assert any(line in n for n in report.notes), report.notes


class AutoScan(nn.Module):
    """The gated delta rule declared with comm="auto" (4 heads: they split over 2 and 4 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.scan = cpcompile.token_mixer(gated_delta_rule, heads_dim=2, comm="auto", state=True)

    def forward(self, q, k, v, g, beta):
        return self.scan(q, k, v, g, beta)[0]


def _scan_inputs(seq: int):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq, 4, 4, generator=gen) for _ in range(3))
    return q, k, v, -torch.rand(1, seq, 4, generator=gen), torch.rand(1, seq, 4, generator=gen)


@pytest.mark.parametrize("seq,strategy", [(64, "flat"), (4, "flat"), (64, "zigzag"), (16, "zigzag")])
def test_auto_picks_the_comm_that_moves_fewer_bytes(seq, strategy):
    """Under flat: state passing where the other 3 ranks' transitions (1 x 4 heads x 4 x (4 + 4) fp32: 3 x 512 =
    1536 bytes) weigh less than 3/4 of a rank's q, k, v, g, beta and output (16 tokens a rank: 3456 bytes), a2a where
    they do not (1 token a rank: 216 bytes). Under zigzag the same, with two transitions a rank (3072 bytes): state
    passing at 16 tokens a rank, a2a at 4 (864 bytes)."""
    torch._dynamo.reset()
    report = cpcompile.explain(AutoScan(), *_scan_inputs(seq), strategy=strategy, world=4)
    assert not report.refusals, report.refusals
    line = next(n for n in report.notes if "gated_delta_rule:" in n)
    expected = {
        (64, "flat"): "state passing, 1536 bytes received a rank per forward call (a2a would receive 3456)",
        (4, "flat"): "a2a, 216 bytes received a rank per forward call",
        (64, "zigzag"): "state passing, 3072 bytes received a rank per forward call (a2a would receive 3456; state "
        "passing on flat chunks would receive 1536); layout zigzag (run of 1 mixer call(s) from gated_delta_rule: "
        "3072 bytes received a rank per forward call on zigzag chunks, 6144 on flat chunks with the relayouts "
        "(4608 of it)",  # q, k, v, g and beta there (224 bytes a token row), the output back (64), 16 rows each way
        (16, "zigzag"): "a2a, 864 bytes received a rank per forward call",
    }
    assert f"gated_delta_rule: {expected[seq, strategy]}" in line, line
    said = "; layout zigzag (run of" in line  # both layouts' prices: zigzag state passing only
    assert said == (strategy == "zigzag" and expected[seq, strategy].startswith("state")), line


def test_explain_under_zigzag_prices_both_layouts():
    """Zigzag, 8 tokens a rank (2 chunks of 4): the conv receives two 3-token tails (576 bytes; flat: 288), the scan
    two transitions from each other rank (1536; flat: 768): 2112 bytes on zigzag chunks. On flat chunks 1056, plus
    the relayouts of x, g and beta (96 + 8 + 8 bytes a token row) there and of the output (32) back, 8 token rows
    each way on ranks 1 and 3 (both their chunks leave, both flat chunks arrive): 1152, 2208 in all, so
    mixer_layout="auto" keeps zigzag here (cpcompile/mixers/relayout_plan.py; tests/graphs/test_relayout.py)."""
    torch._dynamo.reset()
    inputs = (t.repeat(1, 4, *[1] * (t.dim() - 2)) for t in _inputs())
    report = cpcompile.explain(ConvScan(), *inputs, strategy="zigzag", world=4, mixer_layout="auto")
    assert not report.refusals, report.refusals
    run = (
        "layout zigzag (run of 2 mixer call(s) from CausalConv: 2112 bytes received a rank per forward call on zigzag "
        "chunks, 2208 on flat chunks with the relayouts (1152 of it); mixer_layout='auto')"
    )
    for line in (
        "CausalConv: state passing, 576 bytes received a rank per forward call (a2a would receive 1152; state "
        f"passing on flat chunks would receive 288); {run}",
        "gated_delta_rule: state passing, 1536 bytes received a rank per forward call (a2a would receive 864; state "
        f"passing on flat chunks would receive 768); {run}",
    ):
        assert any(line in n for n in report.notes), report.notes
