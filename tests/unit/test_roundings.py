"""The bf16 rounding counts of tests/support/roundings.py, checked against counts derived by hand."""

from tests.support.roundings import dense_partials, packed_partials, roundings


def test_zigzag_all_gather_counts():
    # cp=4 causal: a late chunk has its causal square plus one unmasked run in each gathered slot (3 calls);
    # a key chunk is read by at most two local chunks on every one of the 4 ranks.
    assert dense_partials("zigzag", "all_gather", 4, True, 4, 2) == {"out": 3, "dq": 3, "dk": 8, "dv": 8}
    # non-causal: every local row against each of the 2 slots once; each rank reads a key once.
    assert dense_partials("zigzag", "all_gather", 4, False, 4, 2) == {"out": 2, "dq": 2, "dk": 4, "dv": 4}


def test_a2a_counts_follow_kv_replication():
    # flat a2a: one whole-sequence call a rank; 2 kv heads over 4 ranks: each kv head lives on 2 ranks.
    assert dense_partials("flat", "a2a", 4, True, 8, 2) == {"out": 1, "dq": 1, "dk": 2, "dv": 2}
    assert dense_partials("flat", "a2a", 2, True, 8, 2) == {"out": 1, "dq": 1, "dk": 1, "dv": 1}
    assert packed_partials("thd", "a2a", 4, 8, 2)["dk"] == 2


def test_packed_counts_and_roundings():
    assert packed_partials("thd_zigzag", "all_gather", 4, 4, 4) == {"out": 1, "dq": 1, "dk": 8, "dv": 8}
    assert packed_partials("thd", "all_gather", 2, 4, 4)["dk"] == 2
    assert [roundings(n) for n in (1, 2, 8)] == [1, 3, 9]  # one partial is returned as the kernel rounded it
