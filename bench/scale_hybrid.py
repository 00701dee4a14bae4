"""The scale plan's hybrid part (docs/scale.md, "Qwen3-Next at 1M tokens"): per-rank memory, the bytes each layer
kind moves under each comm, and the expected step time of Qwen3-Next-80B-A3B (36 Gated DeltaNet layers, 12 gated
attention layers, 512-expert MoE in every layer) trained on one 1M-token sequence with cpcompile, computed, printed
as markdown tables.

    python -m bench.scale_hybrid

Shapes are transformers 5.24's `Qwen3NextConfig()` defaults, counted on the meta device (79.67 B parameters).
Every number is an ESTIMATE from those shapes and the byte counts of cpcompile's regions (mixers/cost.py's rules),
except ATTN_TFLOPS and ATTN_EFFICIENCY, which bench/scale.py takes from the H200 measurements (head dim 128 there;
Qwen3-Next's attention has head dim 256, which the measurement does not cover). The GDN kernel rate is an estimate:
flash-linear-attention's kernels could not be timed on the H200 (bench/probes/fla_gdn.py: their backward refuses
Triton 3.6).
"""

from __future__ import annotations

import dataclasses

from bench.scale import ATTN_EFFICIENCY, ATTN_TFLOPS, GIB, HBM_BYTES, LOSS_CHUNK, MATMUL_TFLOPS

HIDDEN, VOCAB, TOTAL_PARAMS = 2048, 151936, 79_674_391_296
ATTN_LAYERS, GDN_LAYERS = 12, 36  # full attention every 4th layer
HQ, HKV, D = 16, 2, 256  # gated attention: q_proj gives query and gate (2 x 16 x 256)
GDN_HK, GDN_HV, GDN_DK, GDN_DV, CONV = 16, 32, 128, 128, 4  # q/k heads repeated to 32 before the scan
CONV_CHANNELS = 2 * GDN_HK * GDN_DK + GDN_HV * GDN_DV  # 8192: the conv runs over q, k and v
EXPERTS_PER_TOKEN, EXPERT_FFN, SHARED_FFN, EXPERTS = 10, 512, 512, 512
LAYER_PARAMS = 1_648_000_000  # the largest layer (GDN + MoE, 1.648 B): what FSDP unshards at a time
ACTIVE_PARAMS = 3.0e9  # parameters a token's forward reads, besides the embedding (the "A3B")
GDN_TFLOPS = 150.0  # ESTIMATE: a chunked gated-delta-rule kernel's rate (not measured on the H200)


@dataclasses.dataclass(frozen=True)
class Setting:
    seq: int
    cp: int
    dp: int
    attention: str  # ring or a2a
    mixers: str  # state (state passing on the layout's chunks) or a2a

    @property
    def tokens(self) -> int:
        return self.seq // self.cp

    @property
    def name(self) -> str:
        return f"{self.seq // 2**20}M cp{self.cp} dp{self.dp} {self.attention}+{self.mixers}"


def gdn_a2a_bytes(tokens: int, cp: int) -> int:
    """A rank's forward bytes received for one GDN layer under a2a: the conv's input and output (8192 channels),
    the scan's q, k, v (32 x 128 each after the repeat), g and beta (32 each) and its output, (cp-1)/cp of each."""
    conv = 2 * CONV_CHANNELS
    scan = 3 * GDN_HV * GDN_DK + 2 * GDN_HV + GDN_HV * GDN_DV
    return 2 * tokens * (conv + scan) * (cp - 1) // cp


def gdn_state_bytes(cp: int, chunks_a_rank: int) -> int:
    """State passing: the conv halo (kernel - 1 tokens of the conv's input, a chunk) and every other chunk's
    transition (B | M): 32 x 128 x (128 + 128) fp32 each. Zigzag has two chunks a rank (chunks_a_rank=2)."""
    halo = chunks_a_rank * (CONV - 1) * CONV_CHANNELS * 2
    transitions = (chunks_a_rank * cp - chunks_a_rank) * GDN_HV * GDN_DK * (GDN_DV + GDN_DK) * 4
    return halo + transitions


def attention_bytes(tokens: int, cp: int, comm: str) -> int:
    """One attention layer's forward bytes received: ring: cp-1 K/V chunks (2 kv heads of 256); a2a: q, k, v and the
    output, (cp-1)/cp of them, the 2 kv heads replicated to cp/2 ranks each where cp > 2."""
    kv = 2 * 2 * HKV * D
    if comm == "ring":
        return (cp - 1) * tokens * kv
    kv_heads = max(HKV, cp)  # a2a replicates kv heads until every rank holds one
    return 2 * tokens * (2 * HQ * D + 2 * kv_heads * D) * (cp - 1) // cp


def block_activations(tokens: int) -> int:
    """bf16 bytes one recomputed block keeps for its backward (the larger kind, a GDN block): input, normed
    input, qkvz and ba projections, conv output, the scan's inputs and output, the gated norm, the o projection; the
    MoE's normed input, router logits (fp32), each routed copy's input, gate, up and product, the shared expert."""
    gdn = 3 * HIDDEN + (2 * CONV_CHANNELS + GDN_HV * GDN_DV) + 64 + CONV_CHANNELS + 4 * GDN_HV * GDN_DV
    moe = HIDDEN + 2 * EXPERTS + EXPERTS_PER_TOKEN * (HIDDEN + 3 * EXPERT_FFN) + 3 * SHARED_FFN
    scan_fp32 = 2 * GDN_HV * (64 + GDN_DV)  # fp32 (x2) intra-chunk scores, decays
    return 2 * tokens * (gdn + moe + scan_fp32)


def comm_buffers(s: Setting) -> int:
    """The larger of one attention layer's and one GDN layer's comm buffers (forward or backward)."""
    kv = 2 * 2 * HKV * D * s.tokens
    attention = 2 * kv + 2 * 2 * kv if s.attention == "ring" else 2 * attention_bytes(s.tokens, s.cp, "a2a")
    mixer = 2 * gdn_a2a_bytes(s.tokens, s.cp) if s.mixers == "a2a" else 2 * gdn_state_bytes(s.cp, 2)
    return max(attention, mixer)


def memory(s: Setting) -> dict[str, int]:
    n = s.dp * s.cp
    out = {
        "weights + grads + Adam fp32 (sharded)": 16 * TOTAL_PARAMS // n,
        "FSDP unsharded bf16 (2 layers) + fp32 grad reduce": 2 * 2 * LAYER_PARAMS + 4 * LAYER_PARAMS,
        "saved block inputs (48 layers)": (ATTN_LAYERS + GDN_LAYERS) * 2 * s.tokens * HIDDEN,
        "one block recomputed + its backward (as much again)": 2 * block_activations(s.tokens),
        "comm buffers of one layer": comm_buffers(s),
        "attention workspace (fp32 acc, dq)": 2 * 4 * s.tokens * HQ * D + GIB // 2,
        "logits + loss (chunked)": min(s.tokens, LOSS_CHUNK) * VOCAB * (2 + 4 + 4) + 2 * VOCAB * HIDDEN,
    }
    out["allocator slack (5%)"] = sum(out.values()) // 20
    return out


def step_seconds(s: Setting) -> dict[str, float]:
    """Attention (12 layers, causal, fwd + bwd + recompute: 9 of 7 matmuls) at the measured rate; GDN scans
    (36 layers; state passing runs the scan on Dv + Dk value columns, twice the work) at the estimated rate;
    the active parameters' GEMMs (8 FLOPs a parameter and token with recompute) at the estimated GEMM rate."""
    attn_flops = ATTN_LAYERS * 9 * 2 * s.seq * s.seq * HQ * D / 2 / s.cp
    attn = attn_flops / (ATTN_TFLOPS * 1e12 * ATTN_EFFICIENCY)
    widen = 2.0 if s.mixers == "state" else 1.0
    per_token_head = 2 * 64 * (GDN_DK + GDN_DV * widen) + 4 * GDN_DK * GDN_DV * widen  # intra-chunk, state; forward
    gdn = GDN_LAYERS * 4.5 * per_token_head * GDN_HV * s.tokens / (GDN_TFLOPS * 1e12)
    gemm = 8 * ACTIVE_PARAMS * s.tokens / (MATMUL_TFLOPS * 1e12)
    total = attn + gdn + gemm
    return {"attention_s": attn, "gdn_s": gdn, "gemm_s": gemm, "step_s": total, "tokens_per_s": s.tokens / total}


SETTINGS = [
    Setting(2**20, 8, 4, "ring", "state"),
    Setting(2**20, 8, 4, "ring", "a2a"),
    Setting(2**20, 16, 2, "ring", "state"),
    Setting(2**20, 32, 1, "ring", "state"),
]


def tables() -> str:
    mems = [memory(s) for s in SETTINGS]
    lines = ["| GiB per rank | " + " | ".join(s.name for s in SETTINGS) + " |", "| --- |" + " --- |" * len(SETTINGS)]
    for key in mems[0]:
        lines.append(f"| {key} | " + " | ".join(f"{m[key] / GIB:.1f}" for m in mems) + " |")
    totals = [sum(m.values()) for m in mems]
    lines.append("| **total** | " + " | ".join(f"**{t / GIB:.1f}**" for t in totals) + " |")
    lines.append("| fits in 139 GiB | " + " | ".join("yes" if t <= HBM_BYTES else "**no**" for t in totals) + " |")
    lines += ["", "| cp (tokens a rank) | GDN a2a MiB | GDN state flat MiB | GDN state zigzag MiB | attention ring MiB "
              "| attention a2a MiB |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for cp in (8, 16, 32):
        t = 2**20 // cp
        row = (gdn_a2a_bytes(t, cp), gdn_state_bytes(cp, 1), gdn_state_bytes(cp, 2))
        row += (attention_bytes(t, cp, "ring"), attention_bytes(t, cp, "a2a"))
        lines.append(f"| {cp} ({t // 1024}K) | " + " | ".join(f"{b / 2**20:,.0f}" for b in row) + " |")
    lines += ["", "| setting | attention s | GDN s | GEMM s | step s | tokens/s/GPU |", "| --- |" + " --- |" * 5]
    for s in SETTINGS:
        t = step_seconds(s)
        lines.append(f"| {s.name} | {t['attention_s']:.0f} | {t['gdn_s']:.1f} | {t['gemm_s']:.1f} | "
                     f"{t['step_s']:.0f} | {t['tokens_per_s']:.0f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    print(tables())
