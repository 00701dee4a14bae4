"""The executor's two-stream scheduling: balance of the assignment, and plain in-order calls off CUDA."""

import torch

from cpcompile.executor.streams import assign, run_calls


def test_assign_balances_work_largest_first():
    # zigzag rank 0 at cp=8 (chunk units): batched squares 2 x 0.5, late chunk vs slot 0 (8), vs slot 1 (7)
    lanes = assign([1.0, 8.0, 7.0])
    assert lanes[1] != lanes[2] and lanes[0] == lanes[2]  # the two big calls side by side, the small one after 7
    assert assign([5.0]) == [0]
    assert sorted(assign([1.0, 1.0, 1.0, 1.0])) == [0, 0, 1, 1]


def test_run_calls_off_cuda_runs_in_order():
    seen = []
    results = run_calls(torch.device("cpu"), [0, 1], [lambda: seen.append(0) or 10, lambda: seen.append(1) or 20])
    assert results == [10, 20] and seen == [0, 1]
