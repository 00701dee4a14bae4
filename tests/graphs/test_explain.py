# ruff: noqa: E501  (the report snapshot keeps its long lines)
"""cpcompile.explain: the report's contract (a snapshot of its table), its agreement with what the backend plans
on every rank, its refusals, and that it needs, creates and changes no process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from expecttest import assert_expected_inline

import cpcompile
from cpcompile.cost import TIE
from cpcompile.cost.work import flops
from cpcompile.explain import report as report_module
from cpcompile.testing.model import TinyConfig, TinyLlama
from cpcompile.testing.varlen_model import VarlenTinyLlama, document_position_ids
from tests.support.fake_pg import capture_graphs, fake_group
from tests.support.graphs import sent_bytes


class Attend(nn.Module):
    """q/k/v projections and causal SDPA (GQA): one attention site, on a line the snapshot names."""

    def __init__(self, mask: bool = False, heads: tuple[int, int] = (4, 2), head_dim: int = 8):
        super().__init__()
        self.heads, self.head_dim, self.mask = heads, head_dim, mask
        self.qkv = nn.Linear(32, (heads[0] + 2 * heads[1]) * head_dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (
            self.qkv(x).view(b, s, -1, self.head_dim).transpose(1, 2).split([self.heads[0], *self.heads[1:] * 2], 1)
        )
        mask = torch.ones(s, s, dtype=torch.bool).tril() if self.mask else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not self.mask, enable_gqa=True)
        return out.transpose(1, 2).flatten(2)


class Bidirectional(Attend):
    """Full (non-causal) attention: every layout's ranks do the same work."""

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (
            self.qkv(x).view(b, s, -1, self.head_dim).transpose(1, 2).split([self.heads[0], *self.heads[1:] * 2], 1)
        )
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).flatten(2)


class CumsumAfter(Attend):
    def forward(self, x):
        return super().forward(x).cumsum(1)  # mixes tokens along the sharded sequence: the token guard refuses


def _tiny(layers=2):
    torch.manual_seed(0)
    model = TinyLlama(TinyConfig(layers=layers))
    ids = torch.randint(0, 128, (2, 64))
    return model, ids, torch.arange(64).expand(2, 64)


def test_report_table_snapshot():
    """Llama-like attention (16 q heads, 4 kv heads, head dim 64), 32K tokens on 4 ranks, on the meta device (no
    memory, nothing computed), planned for CPU kernels (stable across machines: cpu_flash, costed at flash's
    rates)."""
    with torch.device("meta"):
        model, x = Attend(heads=(16, 4), head_dim=64), torch.randn(1, 32768, 32)
    report = cpcompile.explain(model, x, strategy="zigzag", comm="auto", world=4, device="cpu")
    assert_expected_inline(
        str(report),
        """\
cpcompile.explain: strategy=zigzag comm=auto kernel=auto world=4: 1 attention site(s) in 1 graph(s), 0 refusal(s)
est. ms: for one NVIDIA H200 (its measured kernel rates; the CPU kernels are costed at its FlashAttention-2 rates), not
  this CPU: CPU runs check correctness, not speed; report.details() adds shapes and bytes

#  node  source              layout  comm        kernel     blocks/rank  FLOPs/rank  max/mean  est. ms
0  out   test_explain.py:38  zigzag  all_gather  cpu_flash  4/5/5/4      1.92T       1.00      7.37
  site 0: auto chose all_gather + cpu_flash 7.37 ms (runner-up a2a + cpu_flash 7.32 ms) (the planner's estimates)
  estimates: kernel rates measured on NVIDIA H200 (bench/results/single_gpu.json, 2026-11-29..2026-12-07); link 300 GB/s
    per rank assumed; forward + backward (FLOPs too), slowest rank + time on the wire

Refused: nothing

Recommended layout: flat with a2a + cpu_flash: an estimated 9% faster than zigzag (6.72 ms against 7.37 ms), worth
  switching (above 5%, the cost model's error): strategy='flat' in shard_batch and backend
  (the planner's comm per site (comm=auto); forward + backward over 1 site(s) for these shapes: flat 6.72 ms with a2a +
    cpu_flash, FLOPs max/mean per rank 1.00; zigzag 7.37 ms with all_gather + cpu_flash, FLOPs max/mean per rank 1.00)""",
    )


def test_sites_are_what_the_backend_plans_on_every_rank():
    """Blocks, comm and kernel per rank as the real pass plans them (as rank r of a fake group of 4); FLOPs over
    the ranks add up to one device's causal attention; bytes are the comm's wire_bytes."""
    model, ids, pos = _tiny()
    report = cpcompile.explain(model, ids, pos, strategy="zigzag", world=4)
    assert len(report.sites) == 2 and not report.refusals
    for rank in (0, 3):
        with fake_group(rank, 4):
            be = cpcompile.backend(strategy="zigzag", inner="eager")
            torch.compile(model, backend=be, fullgraph=True)(
                *(cpcompile.shard(t, strategy="zigzag", seq_dim=1) for t in (ids, pos))
            )
        for site, plan in zip(report.sites, be.plans):
            assert (site.layout, site.comm, site.kernel) == (plan.layout, plan.comm, plan.kernel)
            assert site.blocks[rank] == plan.block_count()
    site = report.sites[0]
    assert sum(site.flops) == 2 * flops(64 * 65 // 2, 4, 16, 16)  # batch 2, 4 heads, head dim 16


def test_bytes_are_the_traced_collectives():
    """A rank's bytes in the report, summed over the sites, are what the compiled forward and backward graphs
    launch on the wire (the backend on a fake group, rank 1), for both comms (a2a: 4 q / 2 kv heads over 2)."""
    model, ids, pos = _tiny()
    for comm, world in (("all_gather", 4), ("a2a", 2)):
        report = cpcompile.explain(model, ids, pos, strategy="zigzag", comm=comm, world=world)
        assert len(report.sites) == 2 and {s.comm for s in report.sites} == {comm}
        with fake_group(1, world):
            be = cpcompile.backend(strategy="zigzag", comm=comm, inner="eager")
            local = [cpcompile.shard(t, strategy="zigzag", seq_dim=1) for t in (ids, pos)]
            graphs = capture_graphs(model, be, *local)
        for phase in ("fw", "bw"):
            sent = sum(getattr(s.estimate, f"sent_{phase}d") for s in report.sites)
            assert sent == sent_bytes(graphs[phase], world) > 0, (comm, phase)


def test_refusals_name_the_site_and_the_fix():
    report = cpcompile.explain(Attend(mask=True), torch.randn(2, 64, 32), strategy="zigzag", world=4)
    (refusal,) = report.refusals
    assert "explicit attn_mask" in refusal.message and "test_explain.py" in refusal.where and refusal.fix
    assert not report.sites and "token guard did not run" in report.notes[0]

    report = cpcompile.explain(CumsumAfter(), torch.randn(2, 64, 32), strategy="zigzag", world=4)
    assert [r.where for r in report.refusals] == ["token guard"] and "cumsum" in report.refusals[0].message
    assert len(report.sites) == 1

    report = cpcompile.explain(Attend(), torch.randn(2, 60, 32), strategy="zigzag", world=4)
    assert [r.where for r in report.refusals] == ["example inputs"] and "pad_to_multiple" in report.refusals[0].fix


def test_wrong_strategy_is_refused_and_a_layout_recommended():
    report = cpcompile.explain(
        Attend(), torch.randn(2, 64, 32), strategy="thd", world=4, seq_dim=1, cu_seqlens=torch.tensor([0, 64])
    )
    assert "varlen_attn" in report.refusals[0].message
    assert report.recommendation.layout in ("flat", "zigzag")


def test_packed_documents_costed_with_the_batch():
    torch.manual_seed(0)
    model = VarlenTinyLlama(TinyConfig(layers=1), max_len=64)
    cu = torch.tensor([0, 16, 48, 56, 128], dtype=torch.int32)
    ids = torch.randint(0, 128, (128,))
    report = cpcompile.explain(
        model, ids, document_position_ids(cu), cu, strategy="thd", comm="auto", world=4, cu_seqlens=cu
    )
    (site,) = report.sites
    assert site.kind == "varlen" and site.q_shape == (32, 4, 16) and site.blocks == (1, 1, 1, 1)
    assert site.estimate.documents == "this batch's 4 documents"
    assert site.choice is not None and "assumed: documents of 64 tokens" in site.choice.chosen.documents
    docs = [16, 32, 8, 72]
    total = sum(site.flops) if site.comm == "all_gather" else 4 * site.flops[0]
    assert total == flops(sum(n * (n + 1) // 2 for n in docs), 4, 16, 16)
    assert report.recommendation.layout in ("thd", "thd_zigzag") and "thd_zigzag" in report.recommendation.reason


def test_no_process_group_needed_created_or_changed():
    model, ids, pos = _tiny(1)
    assert not dist.is_initialized()
    report = cpcompile.explain(model, ids, pos, strategy="flat", world=4)
    assert not dist.is_initialized() and len(report.sites) == 1
    with fake_group(1, 8) as world:  # the user's own group: left as it is; explain plans for its own world
        report = cpcompile.explain(model, ids, pos, strategy="flat", world=4)
        assert dist.group.WORLD is world and dist.get_world_size() == 8 and dist.get_rank() == 1
    assert report.sites[0].q_shape[2] == 16 and len(report.sites[0].blocks) == 4


def test_meta_model_and_inputs_compute_nothing():
    with torch.device("meta"):
        model, ids, pos = _tiny(1)
    report = cpcompile.explain(model, ids, pos, strategy="zigzag", world=2)
    assert "no attention kernel provider supports meta" in report.refusals[0].message
    assert "pass device=" in report.notes[-1]
    report = cpcompile.explain(model, ids, pos, strategy="zigzag", world=2, device="cpu")
    assert len(report.sites) == 1 and not report.refusals and report.sites[0].kernel == "cpu_flash"


def test_leaves_no_compiled_code_behind():
    from cpcompile.explain.trace import _call

    model, ids, pos = _tiny(1)
    for _ in range(10):  # more than Dynamo's recompile limit (8): every explain starts clean
        assert len(cpcompile.explain(model, ids, pos, strategy="flat", world=2).sites) == 1
    assert not torch._dynamo.eval_frame._debug_get_cache_entry_list(_call.__code__)


def test_attention_run_eagerly_is_refused():
    class Disabled(Attend):
        @torch.compiler.disable
        def forward(self, x):
            return super().forward(x)

    report = cpcompile.explain(Disabled(), torch.randn(2, 64, 32), strategy="flat", world=2)
    assert [r.where for r in report.refusals] == ["eager attention"]


def test_bad_arguments_raise():

    with pytest.raises(cpcompile.CPCompileError, match="unknown strategy"):
        cpcompile.explain(Attend(), torch.randn(2, 64, 32), strategy="ring", world=2)
    with pytest.raises(cpcompile.CPCompileError, match="at least 2 ranks"):
        cpcompile.explain(Attend(), torch.randn(2, 64, 32), world=1)


def test_flex_sites_are_planned_not_costed():
    from torch.nn.attention.flex_attention import flex_attention

    def attend(q, k, v):
        return flex_attention(q, k, v, enable_gqa=True)  # no BlockMask: full attention

    q, k, v = (torch.randn(1, h, 64, 8) for h in (4, 2, 2))
    report = cpcompile.explain(attend, q, k, v, strategy="zigzag", comm="all_gather", world=2, seq_dim=2)
    (site,) = report.sites
    assert (site.kind, site.comm, site.kernel, site.q_shape) == ("flex", "all_gather", "flex", (1, 4, 32, 8))
    assert site.estimate is None and site.blocks is None and report.recommendation is None
    assert "not costed" in report.notes[0] and "  -  " in str(report)
    report = cpcompile.explain(attend, q, k, v, strategy="zigzag", comm="auto", world=2, seq_dim=2)
    assert "does not cost flex_attention" in report.refusals[0].message and "comm='a2a'" in report.refusals[0].fix


def test_thd_balanced_is_explained_with_the_batch_plan_and_selective_bytes():
    """The example batch is cut with its plan (as shard_batch does); comm="selective" shows its static slots
    (C = min(T/cp, max_q) = 24 of 32 tokens a rank) on the wire and what this batch's ranks read."""
    torch.manual_seed(0)
    model = VarlenTinyLlama(TinyConfig(layers=1), max_len=24)
    cu = torch.tensor([0, 16, 40, 56, 72, 96, 120, 128], dtype=torch.int32)
    ids = torch.randint(0, 128, (128,))
    args = (model, ids, document_position_ids(cu), cu)
    kw = dict(strategy="thd_balanced", world=4, cu_seqlens=cu)
    (sel,) = cpcompile.explain(*args, comm="selective", **kw).sites
    (gather,) = cpcompile.explain(*args, comm="all_gather", **kw).sites
    per_token = 2 * 16 * 2 * 4  # kv heads x (D + Dv) x fp32
    assert (sel.comm, sel.q_shape, sel.estimate.documents) == ("selective", (32, 4, 16), "this batch's 7 documents")
    assert (sel.estimate.sent_fwd, gather.estimate.sent_fwd) == (3 * 24 * per_token, 3 * 32 * per_token)
    assert sel.estimate.sent_bwd == sel.estimate.sent_fwd and sel.flops == gather.flops
    report = cpcompile.explain(*args, comm="selective", **kw)
    assert "receives 3 x C=24 K/V token slots a rank" in report.notes[0] and "within C" in report.notes[0]
    thd = cpcompile.explain(*args, comm="selective", strategy="thd", world=4, cu_seqlens=cu)
    assert "read 0 B, 4.1 KB, 2.05 KB, 0 B" in thd.notes[0]  # thd: the documents crossing each rank's first token
    # tiny shapes: selective's smaller wire is no reason to switch to it; a2a's one call over the whole sequence
    # costs least (its region's fixed cost fitted at ~0 on the 2026-12-07 records)
    (auto,) = cpcompile.explain(*args, comm="auto", **kw).sites
    assert auto.comm == "a2a" and {e.comm for e in auto.choice.options} >= {"all_gather", "a2a", "selective"}

    with pytest.raises(cpcompile.CPCompileError, match="regather=True with comm='auto'"):
        cpcompile.backend(comm="auto", regather=True)


def test_compact_table_fits_and_details_add_the_wide_columns():
    """The default table fits in 120 columns and says whose rates it costs at (on CPU: H200's, read as relative);
    details() adds the local shapes and the bytes sent."""
    with torch.device("meta"):
        model, x = Attend(heads=(16, 4), head_dim=64), torch.randn(1, 32768, 32)
    report = cpcompile.explain(model, x, strategy="zigzag", comm="all_gather", world=4, device="cpu")
    assert max(len(line) for line in str(report).splitlines()) <= 120
    assert "est. ms: for one NVIDIA H200" in str(report) and "q / k / v" not in str(report)
    assert "1x16x8192x64 / 1x4x8192x64 / 1x4x8192x64" in report.details() and "sent fwd / bwd" in report.details()


def test_recommendation_keeps_the_comm_asked_for():
    """Asked for all_gather, the advice compares layouts under all_gather (it said "flat with a2a" before)."""
    with torch.device("meta"):
        model, x = Attend(heads=(16, 4), head_dim=64), torch.randn(1, 32768, 32)
    report = cpcompile.explain(model, x, strategy="zigzag", comm="all_gather", world=4, device="cpu")
    reason = report.recommendation.reason
    assert "comm=all_gather, as asked" in reason and "a2a" not in reason, reason
    auto = cpcompile.explain(model, x, strategy="zigzag", comm="auto", world=4, device="cpu").recommendation.reason
    assert "comm=auto" in auto and "a2a" in auto


def _llama_like(model_class=Attend):
    with torch.device("meta"):  # 16 q heads, 4 kv heads, head dim 64, 32K tokens: nothing computed
        return model_class(heads=(16, 4), head_dim=64), torch.randn(1, 32768, 32)


def test_recommendation_agrees_with_the_sites():
    """The asked layout's estimate is the table's est. ms summed, and the recommended layout runs with the comm the
    backend would pick there: explain() asked for that layout shows it per site, costing the same. (It once
    recommended "flat" while every site said zigzag + all_gather, without naming flat's a2a.)"""
    model, x = _llama_like()
    report = cpcompile.explain(model, x, strategy="zigzag", comm="auto", world=4, device="cpu")
    rec = report.recommendation
    assert rec.estimates_ms["zigzag"] == pytest.approx(sum(s.estimate.total_ms for s in report.sites))
    assert rec.layout == "flat" and rec.asked == "zigzag"
    switched = cpcompile.explain(model, x, strategy="flat", comm="auto", world=4, device="cpu")
    assert rec.runs_with == ", ".join(sorted({f"{s.comm} + {s.kernel}" for s in switched.sites})) == "a2a + cpu_flash"
    assert rec.estimates_ms["flat"] == pytest.approx(sum(s.estimate.total_ms for s in switched.sites))
    assert switched.recommendation.layout == "flat"  # the advice does not flip once followed


def test_advice_says_when_switching_is_worth_it():
    """One line: the gain of switching, above cost.TIE worth it; within it the asked layout stands."""
    model, x = _llama_like()
    rec = cpcompile.explain(model, x, strategy="zigzag", comm="auto", world=4, device="cpu").recommendation
    gain = 1 - rec.estimates_ms["flat"] / rec.estimates_ms["zigzag"]
    assert rec.gain == pytest.approx(gain) and gain > TIE
    assert rec.advice().startswith(
        f"Recommended layout: flat with a2a + cpu_flash: an estimated {gain:.0%} faster than zigzag"
    )
    assert "worth switching" in rec.advice() and len(rec.advice().splitlines()) == 1

    model, x = _llama_like(Bidirectional)  # flat and zigzag within the model's error under all_gather
    rec = cpcompile.explain(model, x, strategy="zigzag", comm="all_gather", world=4, device="cpu").recommendation
    assert abs(rec.estimates_ms["flat"] / rec.estimates_ms["zigzag"] - 1) < TIE
    assert rec.layout == "zigzag" and rec.gain == 0.0, rec
    assert rec.advice().startswith("Recommended layout: zigzag, as asked") and "no reason to switch" in rec.advice()


def test_rates_line_names_the_device_the_estimate_is_for(monkeypatch):
    """On CPU the estimate is said to be an H200's; on a GPU the device is named, and another GPU than the one the
    rates were measured on is told to read the ms as relative."""
    lines = {}
    for name in ("NVIDIA H200", "NVIDIA A100-SXM4-80GB"):
        monkeypatch.setattr(report_module, "_cuda_name", lambda name=name: name)
        lines[name] = report_module._rates_line(report_module.Report("zigzag", "auto", "auto", 2, device="cuda"))
    assert lines["NVIDIA H200"] == "est. ms: kernel rates measured on NVIDIA H200, this device"
    assert lines["NVIDIA A100-SXM4-80GB"].endswith("not on this NVIDIA A100-SXM4-80GB: read the ms as relative")
    cpu = report_module._rates_line(report_module.Report("zigzag", "auto", "auto", 2, device="cpu"))
    assert cpu.startswith("est. ms: for one NVIDIA H200") and "not this CPU" in cpu


def test_hf_model_site_names_the_models_line_and_hf_loss_cuts_labels():
    """A Hugging Face model: the source column is the model's own line (not cpcompile's attention op), and
    hf_loss="causal_lm" gives explain the batch shard_batch would (shift_labels, global position_ids)."""

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="cpcompile")
    ids = torch.randint(0, 64, (1, 64))
    report = cpcompile.explain(
        model, input_ids=ids, labels=ids, use_cache=False, strategy="zigzag", hf_loss="causal_lm"
    )
    assert not report.refusals, str(report)
    assert [s.source.split(":")[0] for s in report.sites] == ["modeling_llama.py"]


def test_deferred_merge_says_the_memory_it_holds():
    """zigzag over 4 ranks, 16 fp32 rows a rank, 2 x 4 q heads of 8: the last rank keeps 4 partials of every row
    (out 256 B + lse 32 B a row) against the running merge's fp32 output and lse plus one partial: 9216 B more
    forward; backward 4 dq partials (256 B a row) against the running fp32 dq and one partial: 8192 B."""
    report = cpcompile.explain(Attend(), torch.randn(2, 64, 32), strategy="zigzag", comm="ring", world=4,
                               deferred_merge=True)  # fmt: skip
    (site,) = report.sites
    assert site.deferred_bytes == (9216, 8192)
    assert "deferred merge holds 9.22 KB more in forward, 8.19 KB in backward" in str(report)
    plain = cpcompile.explain(Attend(), torch.randn(2, 64, 32), strategy="zigzag", comm="ring", world=4)
    assert plain.sites[0].deferred_bytes is None and "deferred merge" not in str(plain)
    with pytest.raises(cpcompile.CPCompileError, match=r"deferred_merge=True with comm='a2a'.*use comm='ring'"):
        cpcompile.explain(Attend(), torch.randn(2, 64, 32), strategy="zigzag", comm="a2a", deferred_merge=True)
