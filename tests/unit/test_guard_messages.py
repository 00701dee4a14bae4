"""The run-time guards' device-assert messages fit CUDA's limit (torch 2.11 refuses 255 characters or more:
found on the H200, where the packed check then failed with "Message length must be smaller than 255")."""

from __future__ import annotations

from cpcompile.layouts import STRATEGIES, THD_LAYOUTS
from cpcompile.regions import batch_check, guards
from cpcompile.regions.batch_check import bad_positions_message, unsharded_message
from cpcompile.regions.guards import MAX_MESSAGE, bad_cu_message


def test_assert_messages_fit():
    """Every message constant of the guards module (the dense token check's BAD_POSITIONS was 293 characters: on
    CUDA every graph with position ids then failed at the assert) and every built message, at extreme sizes."""
    longest = bad_cu_message(10**12, 10**12, 2, 10**6)
    assert "cu[-1]=1000000000000" in longest and "2*cp=2000000" in longest
    constants = [v for m in (guards, batch_check) for k, v in vars(m).items() if k.isupper() and isinstance(v, str)]
    assert len(constants) >= 4 and batch_check.PADDED in constants
    built = [longest, bad_cu_message(8, None, 0, 2)]
    built += [lay.bad_metadata_message(10**12, 10**12, 10**6) for lay in THD_LAYOUTS.values()]
    built += [f(layout) for layout in STRATEGIES for f in (bad_positions_message, unsharded_message)]
    for message in constants + built:
        assert len(message) <= MAX_MESSAGE, (len(message), message)


def test_rank_disagreement_names_the_field():
    from cpcompile.passes.agree import differences

    site = "('varlen', 'thd', 'all_gather', 'cpu_varlen_ref', True, 0.25, False, (48, 16, 16), (48, 16, 16), (48, 16, 16), 'torch.bfloat16', 'cpu', 2, (-1, 0), {})"
    said = differences("sites:" + site.format(21), "sites:" + site.format(18), 0, 1)
    assert said.startswith("site 0 differs in max_doc: rank 0 has 21, rank 1 18 (varlen_attn's max_q/max_k")
    assert "GLOBAL packed batch" in said and "get_attention_masks" in said
    said = differences("sites:" + site.format(21), "sites:" + site.format(21).replace("'thd'", "'thd_zigzag'"), 1, 0)
    assert said == "site 0 differs in layout: rank 1 has 'thd', rank 0 'thd_zigzag'. "
    assert differences("sites:" + site.format(21), "sites:", 0, 1) == "rank 0 planned 1 attention sites, rank 1 0. "
    assert differences("error:x", "sites:", 0, 1) == ""


def test_rank_disagreement_names_every_field():
    """Every field of a plan's summary has a name (a mismatch in the last ones, e.g. deferred_merge, was once
    left unnamed: the field names stopped at max_doc)."""
    import ast

    import cpcompile
    from cpcompile.passes.agree import FIELDS, differences, plan_summary
    from tests.graphs.test_ring import _qkv, gqa_attention
    from tests.support.fake_pg import capture_graphs, fake_group

    with fake_group(rank=1, world=2):
        be = cpcompile.backend(strategy="zigzag", comm="ring", inner="aot_eager", deferred_merge=True)
        capture_graphs(gqa_attention, be, *_qkv())
    (plan,) = be.plans
    mine = plan_summary(plan)
    assert len(ast.literal_eval(mine)) == len(FIELDS)
    theirs = mine.replace(", True)", ", False)")  # deferred_merge is the last field
    said = differences("sites:" + mine, "sites:" + theirs, 0, 1)
    assert said == "site 0 differs in deferred_merge: rank 0 has True, rank 1 False. ", said
