"""The token guard's own rules on what real models do (one process, fake CP group): positions made from the LOCAL
length are refused naming the line and the fix; MoE routing over a (B*L, E) flatten, an MoE load-balancing loss,
copies into slices (DeepSeek-V3's new_empty + copy_) and replicated tables read at global positions
(torchtitan's rope_cache[positions]) are followed, not refused, and a mark applies only to what was marked."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cpcompile
from tests.errors.test_token_guard import B, D, L, attend, compile_cp, no_marks, refusal  # noqa: F401
from tests.support.errors import cp_error

POSITIONS_FIX = "pass the tokens' GLOBAL position ids"


def rope(x, pos):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = pos[..., None].float() * inv
    cos, sin = ang.cos().repeat(1, 1, 2), ang.sin().repeat(1, 1, 2)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_from_local_arange(x):
    return attend(rope(x, torch.arange(x.shape[1]).expand(x.shape[0], -1)))


table = nn.Embedding(64, D)


def learned_from_local_arange(x):
    return attend(x + table(torch.arange(x.shape[1])))


class Tables(nn.Module):
    """Model state (buffers): a sinusoidal position table and a RoPE cache, longer than any sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("sinusoid", torch.randn(64, D))
        self.register_buffer("rope_cache", torch.randn(64, D))


tables = Tables()


def sinusoidal_buffer_sliced(x):
    return attend(x + tables.sinusoid[: x.shape[1]])


def temperature_from_local_arange(x):  # Llama 4's NoPE attention temperature
    scale = torch.log(torch.floor((torch.arange(x.shape[1]).float() + 1) / 4) + 1) * 0.1 + 1
    return attend(x * scale[None, :, None])


@pytest.mark.parametrize(
    "fn", [rope_from_local_arange, learned_from_local_arange, sinusoidal_buffer_sliced, temperature_from_local_arange]
)
def test_positions_from_the_local_length_are_refused(no_comm, fn):
    msg = refusal(fn, torch.randn(B, L, D))
    assert f"at {__file__}:" in msg and "LOCAL sequence length" in msg and POSITIONS_FIX in msg, msg


def test_global_positions_are_accepted():
    compile_cp(lambda x, pos: attend(rope(x, pos) + table(pos)), torch.randn(B, L, D), torch.arange(L).expand(B, L))


def test_a_replicated_table_read_at_global_positions_compiles():
    """torchtitan's RoPE: rope_cache[positions], an aten.index into a replicated table by token-holding indices."""
    compile_cp(lambda x, pos: attend(x * tables.rope_cache[pos]), torch.randn(B, L, D), torch.arange(L).expand(B, L))


E, K = 4, 2
router = nn.Linear(D, E, bias=False)
experts = nn.Parameter(torch.randn(E, D, D) * 0.1)


def moe(x):
    """Qwen3-MoE / Mixtral routing: top-k over the experts of a (B*L, E) tensor, dense expert maths."""
    flat = x.reshape(-1, D)
    probs = F.softmax(router(flat), dim=-1)
    weights, chosen = torch.topk(probs, K, dim=-1)
    gate = torch.zeros_like(probs).scatter(1, chosen, weights / weights.sum(-1, keepdim=True))
    out = torch.einsum("td,edf,te->tf", flat, experts, gate)
    return out.reshape(x.shape), probs, chosen


def test_moe_routing_compiles():
    compile_cp(lambda x: attend(moe(x)[0]), torch.randn(B, L, D))


def test_moe_aux_loss_over_tokens_is_refused(no_comm):
    """The load-balancing loss multiplies two means over the tokens: each rank's product of its own means is not
    a share of the product of the global ones."""

    def with_aux(x):
        out, probs, chosen = moe(x)
        tokens_per_expert = F.one_hot(chosen, E).float().mean(dim=(0, 1))
        aux = (tokens_per_expert * probs.mean(0)).sum() * E
        return attend(out).sum() + 0.01 * aux

    msg = refusal(with_aux, torch.randn(B, L, D))
    assert "reduction over tokens" in msg and "aten.mul" in msg, msg


def test_copies_into_slices_keep_the_tokens():
    """DeepSeek-V3's MLA: k = k_pe.new_empty(...); k[..., :d] = k_nope; k[..., d:] = k_pe."""

    def mla(x):
        k = x.new_empty(B, L, 2 * D)
        k[..., :D] = x
        k[..., D:] = x * 2
        return attend(k[..., :D] + k[..., D:])

    compile_cp(mla, torch.randn(B, L, D))

    def mixing_after_copy(x):
        k = x.new_empty(B, L, 2 * D)
        k[..., :D] = x
        k[..., D:] = x
        return attend(x) + k.cumsum(dim=1)[..., :D]

    assert "aten.cumsum" in refusal(mixing_after_copy, torch.randn(B, L, D))


def test_token_wise_product_with_a_local_length_parameter():
    """A token-wise `out * w` whose w has the local length by chance (D == L) is not mistaken for positions."""
    w = nn.Parameter(torch.randn(D))
    assert D == L
    compile_cp(lambda x: attend(x) * w, torch.randn(B, L, D))


def test_flatten_and_unflatten_keep_the_tag(no_comm):
    """(B, L, D) -> (B*L, D) -> (B, L, D): a scan over the tokens after the round trip is still seen."""
    msg = refusal(lambda x: attend(x.reshape(-1, D).reshape(B, L, D)).cumsum(1), torch.randn(B, L, D))
    assert "aten.cumsum" in msg, msg
    msg = refusal(lambda x: attend(x).reshape(-1, D).cumsum(0), torch.randn(B, L, D))
    assert "aten.cumsum" in msg, msg


@pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < "2.13",
    reason="torch 2.11's Dynamo cannot trace a bare BertForMaskedLM call (transformers' lazy module import)",
)
def test_bert_without_position_ids_is_refused(no_comm):
    pytest.importorskip("transformers")
    from tests.support.hf_zoo import build

    model = build("bert", "cpcompile", dtype=torch.float32)
    msg = refusal(lambda ids: model(input_ids=ids).logits, torch.randint(3, 100, (1, 16)))
    assert "LOCAL sequence length" in msg and POSITIONS_FIX in msg, msg


def length_scale(x):
    return attend(x) * x.shape[1]


def log_length_scale(x):  # a log-n attention scale: Dynamo folds math.log(8) into the graph
    return attend(x * math.log(x.shape[1]))


def positions_over_length(x, pos):
    return attend(x * (pos[..., None] / x.size(1)))


@pytest.mark.parametrize("fn,form", [(length_scale, "L"), (log_length_scale, "log(L)"), (positions_over_length, "L")])
def test_the_local_length_as_a_number_is_refused(no_comm, fn, form):
    """x * L, log(L), pos / L with L = x.shape[1]: each rank's L is its share of the tokens (was error 0.5-0.74)."""
    args = (torch.randn(B, L, D),) + ((torch.arange(L).expand(B, L),) if fn is positions_over_length else ())
    msg = refusal(fn, *args)
    assert f"at {__file__}:" in msg and "LOCAL sequence length as a number" in msg, msg
    assert f"is {form} for this rank's length L = {L}" in msg and "use the GLOBAL length" in msg, msg


def test_numbers_that_are_not_the_length_compile():
    """A constant equal to L on a line that reads no size, and sizes read for a view beside other numbers."""
    assert D == L
    compile_cp(lambda x: attend(x) * 8, torch.randn(B, L, D))
    compile_cp(lambda x: attend(x.view(x.shape[0], x.shape[1], 2, -1).flatten(2) * 2), torch.randn(B, L, D))


def test_llama4_temperature_tuning_is_refused(no_comm):
    """Llama 4's NoPE layers scale queries by a temperature of positions it makes from the LOCAL length
    (`torch.arange(hidden_states.shape[1])`); without it the model is in the HF zoo (tests/parity/test_hf_zoo.py)."""
    pytest.importorskip("transformers")
    from tests.support.hf_zoo import build

    model = build("llama4", "cpcompile", dtype=torch.float32, attn_temperature_tuning=True)
    ids, pos = torch.randint(3, 100, (1, 16)), torch.arange(16, 32)[None]
    msg = refusal(lambda ids, pos: model(input_ids=ids, position_ids=pos, use_cache=False).logits, ids, pos)
    assert "modeling_llama4.py" in msg and "query_states * attn_scales" in msg and "torch.arange of the local" in msg, (
        msg
    )
    assert "LOCAL sequence length" in msg and POSITIONS_FIX in msg, msg


def scale_from_an_earlier_line(x, pos):
    n = x.shape[1]  # the local length, read on one line ...
    scale = pos[..., None] / n  # ... used on another (was silent: error 0.42 on 2 ranks)
    return attend(x * scale)


def length_as_a_tensor(x):
    b, n, _ = x.shape
    return attend(x * torch.tensor(n, dtype=x.dtype).log())


def head_scale(x):
    """q * q.shape[-1] ** -0.5 with head_dim == L: the head dim, not the length (was refused)."""
    q = x.view(B, L, 1, D).transpose(1, 2)  # (B, 1, L, D): tokens on dim 2, head_dim D == L
    q = q * q.shape[-1] ** -0.5
    return attend(q.transpose(1, 2).reshape(B, L, D))


def test_the_length_is_followed_through_names_and_tensors(no_comm):
    msg = refusal(scale_from_an_earlier_line, torch.randn(B, L, D), torch.arange(L).expand(B, L))
    assert "LOCAL sequence length as a number" in msg and "scale = pos[..., None] / n" in msg, msg
    assert f"is L for this rank's length L = {L}" in msg, msg
    msg = refusal(length_as_a_tensor, torch.randn(B, L, D))
    assert "a tensor of the local length" in msg and "torch.tensor(n, dtype=x.dtype)" in msg, msg


def test_a_head_dim_equal_to_the_length_is_not_the_length():
    assert D == L
    compile_cp(head_scale, torch.randn(B, L, D))


def test_the_length_is_followed_under_dynamic_shapes(no_comm):
    """A graph with no attention fed shard's tokens, dims dynamic: the token dim's size is a symbol in the graph
    and a number computed from it is the length, whatever its value."""
    from tests.support.fake_pg import fake_group

    def position_scale(x, pos):
        n = x.shape[1] - 1
        return x * (pos[..., None] / n)

    with fake_group(0, 2):
        x = cpcompile.shard(torch.randn(B, 2 * L, D + 4), strategy="zigzag", seq_dim=1)
        pos = cpcompile.shard(torch.arange(2 * L).expand(B, -1), strategy="zigzag", seq_dim=1)
        be = cpcompile.backend(strategy="zigzag", inner="eager")
        with pytest.raises(Exception) as excinfo:
            torch.compile(position_scale, backend=be, dynamic=True)(x, pos)
    msg = str(cp_error(excinfo))
    assert "LOCAL sequence length as a number" in msg and "computed from this rank's length" in msg, msg
