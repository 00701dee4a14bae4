"""The window cpcompile's HF attention maps each windowed model's `sliding_window` to covers exactly HF's own mask.

Each model runs once on one process under a probe attention implementation: its mask function is HF's own
`sdpa_mask`, and its attention records the 4-D mask HF built for the layer and the `sliding_window` / causality
HF passed. The window `hf_window` makes of them must allow exactly the (q, k) pairs HF's
mask allows, causal (Mistral, Qwen2, Gemma 2, Gemma 3) and bidirectional (ModernBERT)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from cpcompile.integrations.hf import hf_window  # noqa: E402
from tests.support.hf_zoo import VOCAB, WINDOW, build  # noqa: E402

PROBE = "cpcompile_window_probe"
SEQ = 16


@pytest.fixture(scope="module")
def seen():
    from transformers import masking_utils
    from transformers.modeling_utils import AttentionInterface

    records = []

    def probe(module, query, key, value, attention_mask, sliding_window=None, is_causal=None, **kwargs):
        causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
        records.append((sliding_window, causal, attention_mask, key.shape[-2]))
        return query.transpose(1, 2).contiguous(), None  # only the masks matter here

    AttentionInterface.register(PROBE, probe)
    masking_utils.AttentionMaskInterface.register(PROBE, masking_utils.sdpa_mask)
    return records


def _modernbert():
    import transformers as T

    cfg = T.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        local_attention=2 * WINDOW, global_attn_every_n_layers=2, attention_dropout=0.0, mlp_dropout=0.0,
        embedding_dropout=0.0, pad_token_id=0,
    )  # fmt: skip
    cfg._attn_implementation = PROBE
    return T.ModernBertForMaskedLM(cfg).eval()


def _window_mask(window: tuple[int, int], causal: bool, n: int) -> torch.Tensor:
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    left, right = window
    allowed = torch.ones(n, n, dtype=torch.bool)
    if left >= 0:
        allowed &= k >= q - left
    if right >= 0:
        allowed &= k <= q + right
    return allowed & (k <= q) if causal else allowed


@pytest.mark.parametrize("name", ["mistral_sw", "qwen2", "gemma2", "gemma3", "modernbert"])
def test_window_is_hf_mask(seen, name):
    seen.clear()
    model = _modernbert() if name == "modernbert" else build(name, PROBE).eval()
    with torch.no_grad():
        model(input_ids=torch.randint(3, VOCAB, (1, SEQ)))
    windowed = [r for r in seen if r[0] is not None]
    assert windowed, f"{name}: no layer got a sliding_window"
    for sliding_window, causal, mask, keys in windowed:
        assert mask is not None and mask.dtype == torch.bool, f"{name}: HF built no boolean mask"
        ours = _window_mask(hf_window(sliding_window, causal, keys), causal, keys)
        assert torch.equal(ours, mask[0, 0]), f"{name}: sliding_window={sliding_window} causal={causal}"
    assert any(not r[1] for r in windowed) == (name == "modernbert")
