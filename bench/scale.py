"""The scale plan of docs/scale.md: per-rank memory by component and the expected step time of Llama3-8B
training at long context with cpcompile, computed (not hand arithmetic), printed as markdown tables.

    python -m bench.scale            # the tables in docs/scale.md

Every number is an ESTIMATE from the model's shapes and the byte counts of the regions' buffers, except the
two rates marked MEASURED (docs/benchmarks.md, one H200): the single-GPU cuDNN attention rate and a zigzag
rank's attention efficiency against it. The lead's bench/memory.py run on one H200 checks the per-rank
activation and K/V-buffer terms (docs/scale.md, "Measured on one H200").
"""

from __future__ import annotations

import dataclasses

GIB = 2**30
HBM_BYTES = 139 * GIB  # what torch can allocate on an H200 ("141 GB"; torch reports ~139.8 GiB total)
HIDDEN, LAYERS, HQ, HKV, D, FFN, VOCAB = 4096, 32, 32, 8, 128, 14336, 128256  # Llama3-8B
ATTN_TFLOPS = 541.0  # MEASURED: single-GPU cuDNN SDPA fwd+bwd at 128K (docs/benchmarks.md, first table)
ATTN_EFFICIENCY = 1.02  # MEASURED: zigzag rank / ideal at 128K, cp 2-8, compute alone (same table)
MATMUL_TFLOPS = 600.0  # ESTIMATE: bf16 GEMMs at ~60% of the H200's 989 dense peak (not measured here)
LOSS_CHUNK = 4096  # tokens per chunk of a chunked output projection + cross-entropy (the user's loss)


def layer_params() -> int:
    attn = HIDDEN * (HQ + 2 * HKV) * D + HQ * D * HIDDEN
    return attn + 3 * HIDDEN * FFN + 2 * HIDDEN


def total_params() -> int:
    return LAYERS * layer_params() + 2 * VOCAB * HIDDEN + HIDDEN  # untied embedding and output


@dataclasses.dataclass(frozen=True)
class Setting:
    seq: int  # tokens of one sequence (batch 1 a dp replica)
    cp: int
    dp: int
    comm: str  # ring, all_gather+regather, all_gather, a2a
    checkpoint: bool = True  # per-block activation checkpointing

    @property
    def tokens(self) -> int:
        return self.seq // self.cp


def kv_buffers(s: Setting) -> int:
    """Peak K/V-side buffers of one layer's attention (forward or backward, whichever is larger)."""
    kv = 2 * 2 * HKV * D  # bf16 K and V of one token
    chunk = s.tokens * kv
    if s.comm == "ring":  # held + arriving chunk; the travelling and the arriving fp32 dK/dV (backward)
        return 2 * chunk + 2 * 2 * chunk
    if s.comm == "a2a":  # exchanged q/k/v and out, and their gradients (Hq/cp, Hkv/cp heads over S tokens)
        return 2 * s.tokens * 2 * (2 * HQ + 2 * HKV) * D
    gathered = s.seq * kv  # all_gather: the gathered K/V, and in backward their fp32 partial dK/dV
    return gathered + 2 * gathered


def saved_kv_all_layers(s: Setting) -> int:
    """all_gather without regather and without checkpointing keeps every layer's gathered K/V for backward."""
    if s.comm == "all_gather" and not s.checkpoint:
        return (LAYERS - 1) * s.seq * 2 * 2 * HKV * D
    return 0


def block_activations(tokens: int) -> int:
    """bf16 bytes one block keeps for backward (no checkpointing): input, normed input, q, k, v, attention output,
    o-projection output; the MLP's normed input, gate, up, and their product."""
    per_token = 3 * HIDDEN + 2 * HQ * D + 2 * HKV * D + HIDDEN + 3 * FFN
    return 2 * tokens * per_token


def block_backward_transient(tokens: int) -> int:
    """bf16 gradients alive at once in a block's backward (the MLP's: gate, up, product; the residual stream)."""
    return 2 * tokens * (3 * FFN + 2 * HIDDEN)


def attention_workspace(tokens: int) -> int:
    """fp32 running output and one step's partial (forward), fp32 dq and one partial (backward), LSE, plus ~0.5
    GiB of kernel workspace."""
    q_fp32 = 4 * tokens * HQ * D
    return 2 * q_fp32 + 4 * tokens * HQ * 2 + GIB // 2


def memory(s: Setting) -> dict[str, int]:
    """Per-rank bytes by component; parameters are sharded by FSDP2 over all dp x cp ranks (fp32 master
    weights, fp32 grads, Adam's two fp32 moments; bf16 compute copies of two layers unsharded at a time)."""
    n = s.dp * s.cp
    p, lp = total_params(), layer_params()
    out = {
        "weights fp32 (sharded)": 4 * p // n,
        "grads fp32 (sharded)": 4 * p // n,
        "Adam moments fp32 (sharded)": 8 * p // n,
        "FSDP unsharded bf16 (2 layers) + fp32 grad reduce": 2 * 2 * lp + 4 * lp,
    }
    if s.checkpoint:
        out["saved block inputs (all layers)"] = LAYERS * 2 * s.tokens * HIDDEN
        out["one block recomputed + its backward"] = block_activations(s.tokens) + block_backward_transient(s.tokens)
    else:
        out["saved activations (all layers)"] = LAYERS * block_activations(s.tokens)
        out["one block's backward transient"] = block_backward_transient(s.tokens)
    out["K/V buffers of one layer (comm)"] = kv_buffers(s)
    out["gathered K/V saved by every layer"] = saved_kv_all_layers(s)
    out["attention workspace (fp32 acc, dq)"] = attention_workspace(s.tokens)
    out["logits + loss (chunked)"] = min(s.tokens, LOSS_CHUNK) * VOCAB * (2 + 4 + 4) + 2 * VOCAB * HIDDEN
    out["allocator slack (5%)"] = sum(out.values()) // 20
    return out


def causal_attention_flops(seq: int) -> float:
    """fwd+bwd FLOPs of causal attention over one sequence, one layer (2 matmuls forward, 5 backward, half)."""
    return 7 * 2 * seq * seq * HQ * D / 2


def step_seconds(s: Setting) -> dict[str, float]:
    """A rank's step time: attention at the measured rate x efficiency (forward recomputed under
    checkpointing: 2 of the 7 matmuls again), GEMMs at the estimated rate; communication assumed hidden."""
    recompute = 9 / 7 if s.checkpoint else 1.0
    attn = LAYERS * causal_attention_flops(s.seq) / s.cp * recompute / (ATTN_TFLOPS * 1e12 * ATTN_EFFICIENCY)
    gemm_factor = 8 if s.checkpoint else 6  # fwd 2, bwd 4, recompute 2 per parameter and token
    gemm = gemm_factor * (total_params() - VOCAB * HIDDEN) * s.tokens / (MATMUL_TFLOPS * 1e12)
    total = attn + gemm
    return {"attention_s": attn, "gemm_s": gemm, "step_s": total, "tokens_per_s_per_gpu": s.tokens / total}


def ring_step_overlap(s: Setting, link_gbps: float) -> tuple[float, float]:
    """(seconds one K/V chunk takes on the link, seconds of attention forward compute per ring step)."""
    chunk = s.tokens * 2 * 2 * HKV * D
    per_step = causal_attention_flops(s.seq) / s.cp * (2 / 7) / s.cp / (ATTN_TFLOPS * 1e12 * ATTN_EFFICIENCY)
    return chunk / (link_gbps * 1e9), per_step


SETTINGS = [Setting(2**20, 8, 1, c) for c in ("ring", "all_gather+regather", "all_gather", "a2a")] + [
    Setting(2**20, 8, 1, "ring", checkpoint=False),
    Setting(2**20, 8, 1, "all_gather", checkpoint=False),
    *(Setting(2**22, 32, 1, c) for c in ("ring", "all_gather+regather", "a2a")),
]


def memory_table(settings: list[Setting]) -> list[str]:
    mems = [memory(s) for s in settings]
    keys = list(dict.fromkeys(k for m in mems for k in m))
    lines = ["| GiB per rank | " + " | ".join(_name(s) for s in settings) + " |", "| --- |" + " --- |" * len(settings)]
    for key in keys:
        lines.append(f"| {key} | " + " | ".join(f"{m[key] / GIB:.1f}" if key in m else "-" for m in mems) + " |")
    totals = [sum(m.values()) for m in mems]
    lines.append("| **total** | " + " | ".join(f"**{t / GIB:.1f}**" for t in totals) + " |")
    lines.append("| fits in 139 GiB | " + " | ".join("yes" if t <= HBM_BYTES else "**no**" for t in totals) + " |")
    return lines


def tables() -> str:
    lines = memory_table(SETTINGS[:6]) + [""] + memory_table(SETTINGS[6:])
    lines += ["", "| setting | attention s | GEMM s | step s | tokens/s/GPU |", "| --- | --- | --- | --- | --- |"]
    seen = set()
    for s in SETTINGS:  # communication is assumed hidden, so the comm does not change the time
        if (s.seq, s.cp, s.checkpoint) in seen:
            continue
        seen.add((s.seq, s.cp, s.checkpoint))
        t = step_seconds(s)
        lines.append(
            f"| {_name(s, comm=False)} | {t['attention_s']:.0f} | {t['gemm_s']:.1f} | {t['step_s']:.0f} | "
            f"{t['tokens_per_s_per_gpu']:.0f} |"
        )
    lines += ["", "| setting | link GB/s | one K/V chunk on the link ms | attention fwd per ring step ms |"]
    lines.append("| --- | --- | --- | --- |")
    for s, link in ((SETTINGS[0], 300.0), (SETTINGS[6], 300.0), (SETTINGS[6], 40.0)):
        wire, step = ring_step_overlap(s, link)
        lines.append(f"| {_name(s)} | {link:.0f} | {wire * 1e3:.1f} | {step * 1e3:.0f} |")
    return "\n".join(lines)


SCALES = ((2**20, 8, None), (2**22, 32, (4, 8)))
"""1M on one node of 8; 4M on 4 nodes of 8, as a 2-D CP mesh (cp_inter 4 x cp_intra 8) or flat over 32."""


def auto_choices() -> list[str]:
    """What comm="auto" picks for a Llama3-8B attention site (zigzag, cuDNN) at each scale, from cpcompile's own
    cost model (its assumed links: cost/rates.json), with every option's estimate."""
    from cpcompile.comms.registry import COMMS
    from cpcompile.cost import SiteShape
    from cpcompile.families.auto import resolve
    from cpcompile.families.sdpa.costing import DENSE

    lines = ["| setting | auto picks | options: estimated ms a layer (wire ms) |", "| --- | --- | --- |"]
    for seq, cp, levels in SCALES:
        shape = SiteShape(DENSE, 1, seq // cp, HQ, HKV, D, D, 2, 4, True, cp, levels=levels)
        comms = [c for c in COMMS if c != "selective" and (levels or c != "hierarchical")]
        comm, _, choice = resolve(shape, "zigzag", comms, ["cudnn"])
        options = ", ".join(f"{e.comm} {e.total_ms:,.0f} ({e.wire_ms:,.0f})" for e in choice.options)
        mesh = f" as {levels[0]}x{levels[1]}" if levels else ""
        lines.append(f"| {seq // 2**20}M cp{cp}{mesh} | {comm} | {options} |")
    return lines


def _name(s: Setting, comm: bool = True) -> str:
    seq = f"{s.seq // 2**20}M" if s.seq >= 2**20 else f"{s.seq // 1024}K"
    return f"{seq} cp{s.cp} dp{s.dp}{' ' + s.comm if comm else ''}{'' if s.checkpoint else ' no-AC'}"


if __name__ == "__main__":
    print(f"Llama3-8B: {total_params() / 1e9:.2f} B parameters, {layer_params() / 1e6:.0f} M a layer\n")
    print(tables())
    print()
    print("\n".join(auto_choices()))
