"""A tiny hybrid model for the token-mixer tests: blocks of a depthwise causal conv plus a chunked gated linear
recurrence (pure torch, per head, a Python loop over chunks), and a softmax attention block (SDPA), both declared
mixers with cpcompile.token_mixer. Every head count comes from the inputs' shapes, as the declaration asks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import cpcompile


class CausalConv(nn.Module):
    """HF's causal_conv1d torch fallback: a depthwise conv over tokens, (B, L, C) -> (B, L, C), channel-local."""

    def __init__(self, channels: int, kernel: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels, 1, kernel) * 0.4)
        self.bias = nn.Parameter(torch.randn(channels) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        y = F.conv1d(x.transpose(1, 2), self.weight, self.bias, padding=self.weight.shape[-1] - 1, groups=x.shape[-1])
        return F.silu(y[..., :n]).transpose(1, 2)


class GatedRecurrence(nn.Module):
    """Chunked gated linear attention per head (a scalar decay a token, like Mamba2's SSD or GLA):
    o_t = sum_{s<=t} exp(G_t - G_s) (q_t . k_s) v_s, G the running sum of log decays; chunk by chunk, the
    state S (B, H, Dk, Dv) carried between chunks. q/k/v (B, L, H, D), a (B, L, H) decay logits; A_log (H,) a
    per-head rate (split with the heads), norm (Dv,) shared by every head (not split)."""

    def __init__(self, heads: int, head_dim: int, chunk: int = 4) -> None:
        super().__init__()
        self.chunk = chunk
        self.A_log = nn.Parameter(torch.randn(heads) * 0.3)
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(head_dim))

    def forward(self, q, k, v, a):
        b, n, h, d = q.shape
        logg = -F.softplus(a) * self.A_log.exp()  # (B, L, H), <= 0
        q, k, v, logg = (t.transpose(1, 2) for t in (q, k, v, logg))  # heads first
        state = q.new_zeros(b, h, d, v.shape[-1])
        outs = []
        for c0 in range(0, n, self.chunk):
            qc, kc, vc = (t[:, :, c0 : c0 + self.chunk] for t in (q, k, v))
            g = logg[:, :, c0 : c0 + self.chunk].cumsum(-1)  # (B, H, C)
            c = g.shape[-1]
            decay = (g[..., :, None] - g[..., None, :]).masked_fill(
                ~torch.ones(c, c, dtype=torch.bool, device=q.device).tril(), float("-inf")
            )
            intra = (qc @ kc.transpose(-1, -2)) * decay.exp()
            outs.append(intra @ vc + (qc * g[..., None].exp()) @ state)
            last = g[..., -1:]
            state = state * last[..., None].exp() + (kc * (last - g)[..., None].exp()).transpose(-1, -2) @ vc
        o = torch.cat(outs, dim=2).transpose(1, 2)  # (B, L, H, Dv)
        return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm


class MixerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.in_proj = nn.Linear(dim, 3 * heads * head_dim + heads)
        self.conv = cpcompile.token_mixer(CausalConv(3 * heads * head_dim), heads_dim=2)
        self.scan = cpcompile.token_mixer(GatedRecurrence(heads, head_dim), heads_dim=2)
        self.out_proj = nn.Linear(heads * head_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h, d = self.heads, self.head_dim
        qkv, a = self.in_proj(x).split([3 * h * d, h], dim=-1)
        q, k, v = self.conv(qkv).view(b, n, 3, h, d).unbind(2)
        return x + self.out_proj(self.scan(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, a).flatten(2))


class AttentionBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, dim = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(o.transpose(1, 2).reshape(b, n, dim))


class HybridModel(nn.Module):
    """embed -> mixer block -> attention block -> mixer block -> head: (B, L) ids -> (B, L, vocab) logits."""

    def __init__(self, vocab: int = 32, dim: int = 32, heads: int = 4, head_dim: int = 8, attn_heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            [MixerBlock(dim, heads, head_dim), AttentionBlock(dim, attn_heads), MixerBlock(dim, heads, head_dim)]
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def out_of_the_box(cls, cfg) -> nn.Module:
    """cls(cfg) (attn_implementation="cpcompile"), which must declare the two token mixers its modeling module calls
    by itself: their earlier declarations in this process (another test's) are undone first, so each build is a
    fresh process's."""
    import sys

    from cpcompile.mixers import HF_MIXERS, restore_hf_mixers

    restore_hf_mixers(cls)
    modeling = sys.modules[cls.__module__]
    before = {name: getattr(modeling, name) for name in HF_MIXERS if hasattr(modeling, name)}
    model = cls(cfg)
    declared = [name for name, fn in before.items() if getattr(modeling, name) is not fn]
    assert len(declared) == 2, (cls.__name__, declared, sorted(before))
    return model


def hf_hybrid(name: str, cp: int, vocab: int = 32, attn_head_dim: int = 8) -> nn.Module:
    """A tiny HF hybrid (transformers 5.24), one linear/SSM layer then one attention layer, its token mixers declared by
        attn_implementation="cpcompile" itself (out_of_the_box); (B, L) ids [, position ids] -> logits. qwen3_next: a Gated DeltaNet layer
        (k:v heads 1:2) and MoE MLPs; bamba: a Mamba2 layer (SSD, cp groups of B/C); granitemoehybrid: Mamba2 and
        MoE. `attn_head_dim`: the attention head dim (CUDA's fp32 provider takes 16 and up; zamba2's is 16 always: its
    attention reads the embeddings and the hidden state side by side)."""
    import transformers

    if name == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=attn_head_dim, linear_num_key_heads=cp, linear_num_value_heads=2 * cp, linear_key_head_dim=8,
            linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
            layer_types=["linear_attention", "full_attention"],
        )  # fmt: skip
        cfg._experts_implementation = "batched_mm"  # the default grouped_mm takes no fp64
        cls = transformers.Qwen3NextForCausalLM
    elif name == "bamba":
        cfg = transformers.BambaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=32 // attn_head_dim, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=cp,
            mamba_d_state=8, mamba_chunk_size=4, mamba_expand=2, num_logits_to_keep=None,
        )  # fmt: skip
        cls = transformers.BambaForCausalLM
    elif name == "falcon_h1":  # every layer runs attention and Mamba2 side by side
        cfg = transformers.FalconH1Config(
            vocab_size=vocab, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=attn_head_dim, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=cp,
            mamba_d_state=8, mamba_chunk_size=4, mamba_expand=2, num_logits_to_keep=None,
        )  # fmt: skip
        cls = transformers.FalconH1ForCausalLM
    elif name == "zamba2":  # Mamba2 layers, then a hybrid layer: the shared attention block before a Mamba2
        cfg = transformers.Zamba2Config(
            vocab_size=vocab, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
            layers_block_type=["mamba", "hybrid"], num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=4,
            mamba_ngroups=cp, mamba_d_state=8, chunk_size=4, mamba_expand=2, use_mamba_kernels=False,
        )  # fmt: skip
        cls = transformers.Zamba2ForCausalLM
    elif name == "nemotron_h":
        cfg = transformers.NemotronHConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=32, layers_block_type=["mamba", "attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=attn_head_dim, ssm_state_size=8, mamba_num_heads=4,
            mamba_head_dim=16, n_groups=cp, chunk_size=4, expand=2, use_mamba_kernels=False,
        )  # fmt: skip
        cls = transformers.NemotronHForCausalLM
    elif name == "jamba":  # Mamba1 (B/C shared by every channel: all-gathered) then attention, MoE MLPs
        cfg = transformers.JambaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=32 // attn_head_dim, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=2, mamba_dt_rank=4, num_logits_to_keep=None,
        )  # fmt: skip
        cfg._experts_implementation = "batched_mm"
        cls = transformers.JambaForCausalLM
    elif name == "granitemoehybrid":
        cfg = transformers.GraniteMoeHybridConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=32 // attn_head_dim, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=16,
            layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_n_groups=cp, mamba_d_state=8,
            mamba_d_head=16, mamba_chunk_size=4, position_embedding_type="rope",
        )  # fmt: skip
        cfg._experts_implementation = "batched_mm"
        cls = transformers.GraniteMoeHybridForCausalLM
    cfg._attn_implementation = "cpcompile"
    cfg.use_cache = False
    model = out_of_the_box(cls, cfg)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, position_ids=None):
            return self.model(input_ids=ids, position_ids=position_ids, use_cache=False).logits

    return Logits()
