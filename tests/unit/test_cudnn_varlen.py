"""The cuDNN THD provider on CPU: its registration and absence, and its plumbing against a stand-in for the op.

The stand-in (tests/support/cudnn_stand_in.py) implements cudnn-frontend 1.32's op contract with cpu_varlen_ref's math
and poisons what the real kernel may leave undefined, so these tests check what cpcompile adds: cu_seqlens
from ranges, the band keywords, the lse layouts (token-major out, padded in), zeros for unseen keys, and that
the graph keys do not depend on the documents. The real op: tests/gpu/test_cudnn_varlen.py on a GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest
import torch

from cpcompile import CPCompileError
from cpcompile.executor import encode_varlen, prepare_blocks
from cpcompile.kernels import VARLEN_AUTO_ORDER, get_varlen_kernel, resolve_kernel, supported_kernels
from cpcompile.kernels import cudnn_graph as cg
from cpcompile.kernels import cudnn_varlen as cv
from cpcompile.kernels.cpu_varlen_ref import _mask
from cpcompile.layouts.thd import THD_LAYOUTS, whole_sequence_blocks
from tests.support.cudnn_stand_in import CuDNNStandIn
from tests.support.thd_parity import cu_of

CUDA = torch.device("cuda")
OPS = torch.ops.cpcompile
REF = get_varlen_kernel("cpu_varlen_ref")
IMPL = get_varlen_kernel("cudnn_varlen")


@pytest.fixture(params=["split", "one_call"])
def stand_in(monkeypatch, request):
    """The op's CPU stand-in; the split rule's row threshold at 0 (`split` in the test id: every causal block with
    cut pieces runs as cudnn_split's two calls) or as shipped (these blocks are far smaller: one call)."""
    ops = CuDNNStandIn()
    monkeypatch.setattr(cv, "_ops", lambda: ops)
    if request.param == "split":
        monkeypatch.setattr(cv, "SPLIT_MIN_ROWS", 0)
    return ops


@pytest.fixture(params=["padded", "ragged"])
def stats_form(request, monkeypatch):
    """Both forms the backward reads its stats in (cudnn_graph.reads_ragged_stats: ragged where the GPU takes
    them, padded on SM8x / SM12x); the stand-in rebuilds each from the metadata and checks it."""
    monkeypatch.setattr(cg, "reads_ragged_stats", lambda device: request.param == "ragged")
    return request.param


@pytest.fixture
def cuda_here(monkeypatch):
    """Make the device checks pass on this CPU machine (nothing runs on the device)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    forget = cv._import_problem.cache_clear  # the import check runs once a process: rerun it here and after
    forget()
    yield
    forget()


def test_weighed_by_auto_after_fa2_and_nothing_imports_the_package():
    # ties go to flash_varlen: cudnn-frontend's per-call host time (kernels.VARLEN_AUTO_ORDER's docstring)
    assert VARLEN_AUTO_ORDER == ("flash_varlen", "cudnn_varlen", "cpu_varlen_ref") and IMPL.supports_window
    assert "cudnn" not in sys.modules or importlib.util.find_spec("cudnn") is not None
    assert "CUDA tensors only" in IMPL.supports(torch.device("cpu"), torch.bfloat16)
    assert resolve_kernel("auto", torch.device("cpu"), torch.float32, 8, varlen=True) == "cpu_varlen_ref"


def test_absent_package_is_one_clear_error_and_auto_takes_flash_varlen(cuda_here):
    if importlib.util.find_spec("cudnn") is not None:
        pytest.skip("cudnn-frontend is installed here")
    with pytest.raises(CPCompileError, match=r"kernel 'cudnn_varlen' cannot run here: .*'nvidia-cudnn-frontend' is "
                       r"not installed \(pip install 'cpcompile\[cudnn\]'\)"):  # fmt: skip
        resolve_kernel("cudnn_varlen", CUDA, torch.bfloat16, 128, varlen=True)
    assert resolve_kernel("auto", CUDA, torch.bfloat16, 128, varlen=True) == "flash_varlen"


def test_a_frontend_without_the_torch_ops_says_which_version(cuda_here, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "cudnn" else None)

    def old_frontend(name, *a):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(importlib, "import_module", old_frontend)
    assert "nvidia-cudnn-frontend>=1.32" in IMPL.supports(CUDA, torch.bfloat16)


def test_auto_weighs_it_where_it_runs_and_takes_it_alone_for_mla_head_dims(cuda_here, monkeypatch):
    monkeypatch.setattr(cv, "_import_problem", lambda: None)
    assert supported_kernels(CUDA, torch.bfloat16, 128, varlen=True) == ["flash_varlen", "cudnn_varlen"]
    assert resolve_kernel("auto", CUDA, torch.bfloat16, 128, varlen=True) == "flash_varlen"  # the tie-break
    # MLA: FA2 varlen takes one head dim for q/k/v, so cuDNN is the only CUDA option
    assert supported_kernels(CUDA, torch.bfloat16, 192, varlen=True, v_head_dim=128) == ["cudnn_varlen"]
    assert resolve_kernel("auto", CUDA, torch.bfloat16, 192, varlen=True, v_head_dim=128) == "cudnn_varlen"
    with pytest.raises(CPCompileError, match="multiple of 8"):
        resolve_kernel("cudnn_varlen", CUDA, torch.bfloat16, 12, varlen=True)
    with pytest.raises(CPCompileError, match="float16/bfloat16"):
        resolve_kernel("cudnn_varlen", CUDA, torch.float32, 128, varlen=True)


@pytest.mark.parametrize(
    "causal,window,expected",
    [
        (False, (-1, -1), {}),
        (True, (-1, -1), {"is_causal": True, "causal_bottom_right": True}),
        (True, (4, -1), {"is_causal": True, "window_left": 5, "causal_bottom_right": True}),
        (False, (4, 0), {"is_causal": True, "window_left": 5, "causal_bottom_right": True}),
        (False, (0, 0), {"is_causal": True, "window_left": 1, "causal_bottom_right": True}),
        (False, (8, 4), {"window_right": 4, "window_left": 9, "causal_bottom_right": True}),
        (False, (-1, 3), {"window_right": 3, "causal_bottom_right": True}),
        (False, (2, -1), {"window_left": 3, "causal_bottom_right": True}),
    ],
)
def test_band_keywords(causal, window, expected):
    """cuDNN's left band bound counts the diagonal: flash's window left w is w + 1 (sm90 config: W = bound - 1)."""
    assert cv.band(causal, window) == expected
    # square ranges: the same band on cuDNN's default (top-left) anchor, the faster kernel there
    top_left = {k: v for k, v in expected.items() if k != "causal_bottom_right"}
    assert cv.band(causal, window, square=True) == top_left


SQUARE = torch.tensor([[0, 3, 3, 9], [3, 3, 9, 10], [0, 3, 3, 9], [3, 3, 9, 10]])  # 3x3, 0x0, 6x6, 1x1
RECTANGLE = torch.tensor([[0, 3], [3, 7], [0, 5], [5, 12]])  # 3 rows / 5 keys, 4 rows / 7 keys


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (True, (2, -1)), (False, (1, 2)), (False, (-1, 1))])
def test_square_blocks_run_top_left_and_a_false_claim_shows(stand_in, causal, window):
    """square=True asks for the top-left anchor (the stand-in, like the op, anchors top-left without
    causal_bottom_right): on square ranges the contract's results, exactly; on rectangular ranges other results,
    so a layout that claimed square ranges it does not have fails every stand-in test."""
    g = torch.Generator().manual_seed(5)
    kw = {"window": window} if window != (-1, -1) else {}
    for ranges, same in ((SQUARE, True), (RECTANGLE, False)):
        tq, tk = int(ranges[1].max()), int(ranges[3].max())
        q, k, v, dout = _tensors(g, tq, tk)
        bounds = (int((ranges[1] - ranges[0]).max()), int((ranges[3] - ranges[2]).max()))
        stand_in.graphs.clear()
        out, lse = IMPL.forward(q, k, v, ranges, *bounds, causal, 0.3, square=True, **kw)
        assert {key[-1] for key in stand_in.graphs} == {True}, "square=True runs the top-left band"
        want_out, want_lse = REF.forward(q, k, v, ranges, *bounds, causal, 0.3, **kw)
        got = IMPL.backward(dout, q, k, v, want_out, want_lse, ranges, *bounds, causal, 0.3, square=True, **kw)
        want = REF.backward(dout, q, k, v, want_out, want_lse, ranges, *bounds, causal, 0.3, **kw)
        pairs = zip((out, lse, *got), (want_out, want_lse, *want))
        close = [torch.allclose(a.double(), b.double(), atol=1e-6) for a, b in pairs]
        assert all(close) if same else not close[0], (same, close)


def _random_ranges(g: torch.Generator, causal: bool, tiled: bool):
    """Increasing ranges with empty ones (q or k side) and gaps (one side at a time, as the layouts make them);
    causal ranges have q_len <= k_len (a q range ends its key range). Tiled: no gaps, q_len > 0 where k_len > 0."""
    qs, qe, ks, ke, q, k = [], [], [], [], 0, 0
    for _ in range(int(torch.randint(1, 6, (1,), generator=g))):
        kn = int(torch.randint(0, 7, (1,), generator=g))
        qn = int(torch.randint(1 if tiled and kn else 0, (kn if causal else 6) + 1, (1,), generator=g))
        qn = 0 if tiled and not kn else qn
        gap_q, gap_k = (0, 0) if tiled else (int(torch.randint(0, 3, (1,), generator=g)),) * 2
        gap_q, gap_k = (gap_q, 0) if torch.rand(1, generator=g) < 0.5 else (0, gap_k)
        qs.append(q), qe.append(q + qn), ks.append(k), ke.append(k + kn)
        q, k = q + qn + gap_q, k + kn + gap_k
    return torch.tensor([qs, qe, ks, ke]), q, k


def _tensors(g, tq, tk, hq=4, hkv=2, d=8, dv=8):
    shapes = [(tq, hq, d), (tk, hkv, d), (tk, hkv, dv), (tq, hq, dv)]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(
    "causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (3, -1)), (False, (2, 1)), (False, (-1, 2))]
)
def test_provider_matches_the_reference_where_the_contract_defines_it(stand_in, stats_form, seed, causal, window):
    """Rows of live sequences (out, lse, dq) and keys of sequences with rows (dk, dv, incl. exact zeros for keys
    no row sees) equal cpu_varlen_ref's; the rest is the kernel's business (masked by the executor)."""
    g = torch.Generator().manual_seed(seed)
    tiled = seed % 3 == 0
    ranges, tq, tk = _random_ranges(g, causal or window[1] == 0, tiled)
    dims = (8, 8) if seed % 2 else (16, 8)  # MLA head dims too
    q, k, v, dout = _tensors(g, max(tq, 1), max(tk, 1), d=dims[0], dv=dims[1])
    bounds = (max(int((ranges[1] - ranges[0]).max()), 1), max(int((ranges[3] - ranges[2]).max()), 1))
    kw = {"window": window} if window != (-1, -1) else {}
    kw |= {"tiled": True} if tiled else {}
    out, lse = IMPL.forward(q, k, v, ranges, *bounds, causal, 0.3, **kw)
    want_out, want_lse = REF.forward(q, k, v, ranges, *bounds, causal, 0.3, **kw)
    assert lse.shape == want_lse.shape and lse.dtype == torch.float32 and out.shape == want_out.shape
    qs, qe, ks, ke = ranges
    mask = _mask(ranges, q.shape[0], k.shape[0], causal, window if window != (-1, -1) else (-1, -1))
    rows = mask.any(1)  # rows that see a key
    torch.testing.assert_close(out[rows], want_out[rows], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse[:, rows].double(), want_lse[:, rows], rtol=1e-6, atol=1e-6)
    final_lse = torch.where(rows, want_lse, float("-inf"))  # what the executor hands the backward
    got = IMPL.backward(dout, q, k, v, want_out, final_lse, ranges, *bounds, causal, 0.3, **kw)
    want = REF.backward(dout, q, k, v, want_out, final_lse, ranges, *bounds, causal, 0.3, **kw)
    kid = torch.full((k.shape[0],), -1)
    for i, (a, z) in enumerate(zip(ks.tolist(), ke.tolist())):
        kid[a:z] = i
    keys = (kid >= 0) & ((qe - qs) > 0)[kid.clamp(min=0)]  # keys of ranges with rows: all defined, 0 if unseen
    torch.testing.assert_close(got[0][rows], want[0][rows], rtol=1e-6, atol=1e-6)
    for g_, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g_[keys], w[keys].to(g_.dtype), rtol=1e-6, atol=1e-6)
        assert bool((g_[keys & ~mask.any(0)] == 0).all()), "a key no row sees must get an exact zero"


def test_padded_lse_puts_each_row_at_its_sequence_and_position():
    ranges = torch.tensor([[0, 3, 3], [3, 3, 7], [0, 5, 9], [4, 9, 12]])  # the middle range has no rows
    lse = torch.arange(2 * 8, dtype=torch.float32).view(2, 8)
    for tiled, per_range in ((True, 1), (False, 2)):
        padded = cv.padded_lse(lse, ranges, 3 * per_range, 4, tiled)
        assert padded.shape == (3 * per_range, 2, 4, 1) and padded.is_contiguous()
        for i, (a, z) in enumerate(zip(ranges[0].tolist(), ranges[1].tolist())):
            for t in range(a, z):
                assert torch.equal(padded[i * per_range, :, t - a, 0], lse[:, t])


def test_unseen_keys_are_the_leading_keys_out_of_the_window():
    ranges = torch.tensor([[0, 2, 2], [2, 2, 5], [0, 6, 8], [6, 8, 12]])  # 2 rows/6 keys, none/2 keys, 3/4
    unseen = cv.unseen_keys(ranges, 12, left=1)
    assert unseen.tolist() == [True] * 3 + [False] * 3 + [True] * 2 + [False] * 4
    expected = ~_mask(ranges, 5, 12, True, (1, -1)).any(0)
    assert torch.equal(unseen, expected)


def _layout_case(layout_name, lengths, cp, rank, causal, window, g, max_doc=None):
    """A rank's block of a layout ("whole": a2a's cp=1 block) with inputs; `max_doc` defaults to the longest."""
    cu, max_doc = cu_of(lengths), max_doc or max(lengths)
    if layout_name in THD_LAYOUTS:
        cu = THD_LAYOUTS[layout_name].prepare(cu, sum(lengths), cp)  # thd_balanced: this batch's plan
    total, local = sum(lengths), sum(lengths) // cp
    if layout_name == "whole":
        (block,) = whole_sequence_blocks(cu, total, causal, window, max_doc)
        q, k, v, dout = _tensors(g, total, total)
        return q, k, v, dout, block
    layout = THD_LAYOUTS[layout_name]
    (block,) = layout.blocks(cu, local, cp, rank, causal, max_doc, window)
    index, _ = layout.key_buffer(cu, local, cp, rank, causal) or (None, None)
    keys = total if index is None else index.numel()
    q, k, v, dout = _tensors(g, local, keys)
    return q, k, v, dout, block


def _both_kernels(q, k, v, dout, block):
    """(out, lse, dq, dk, dv) through the varlen executor on the cuDNN provider (stand-in) and on the reference."""
    spec, ranges = encode_varlen([block]), [block.ranges]
    return [_through_executor(q, k, v, dout, ranges, spec, kernel) for kernel in ("cudnn_varlen", "cpu_varlen_ref")]


def _through_executor(q, k, v, dout, ranges, spec, kernel):
    """(out, lse, dq, dk, dv) of the executor ops on `kernel`, with the blocks' metadata prepared as a region does."""
    meta = prepare_blocks(ranges, spec, q.shape[0], [k.shape[0]], kernel)
    out, lse = OPS.attend_varlen_blocks(q, [k], [v], ranges, spec, 0.3, kernel, meta)
    dq, (dk,), (dv,) = OPS.attend_varlen_blocks_backward(dout, q, [k], [v], out, lse, ranges, spec, 0.3, kernel, meta)
    return out, lse, dq, dk, dv


LAYOUT_LENGTHS = {"thd_zigzag": [8, 0, 24, 8, 16, 0], "thd_balanced": [1, 0, 29, 6, 1, 11]}


@pytest.mark.parametrize("layout_name", ["thd", "thd_zigzag", "thd_balanced", "whole"])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (5, -1))])
def test_executor_on_the_provider_equals_the_reference(stand_in, stats_form, layout_name, causal, window):
    """Through the varlen executor (its masks where a block does not vouch), every layout's rank block: out,
    lse and gradients equal cpu_varlen_ref's exactly where the block defines them, NaN nowhere; blocks that
    claim square ranges (whole documents, thd's rank 0) run top-left on the stand-in, as on cuDNN."""
    g = torch.Generator().manual_seed(3)
    lengths = LAYOUT_LENGTHS.get(layout_name, [1, 0, 13, 6, 1, 11])
    squares = []
    for rank in range(2):
        q, k, v, dout, block = _layout_case(layout_name, lengths, 2, rank, causal, window, g)
        squares.append(block.square)
        used = int(block.ranges[3].max())  # thd_balanced's key buffer ends in a tail no range reads
        for i, (got, want) in enumerate(zip(*_both_kernels(q, k, v, dout, block))):
            got, want = (got, want) if i < 3 else (got[:used], want[:used])
            assert not got.isnan().any()
            torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-6)
    assert squares == {"whole": [True, True], "thd": [causal, False]}.get(layout_name, [False, False])


@pytest.mark.parametrize("layout_name", ["thd", "thd_zigzag", "thd_balanced"])
def test_causal_blocks_with_cut_pieces_split_onto_the_top_left_anchor(stand_in, stats_form, layout_name):
    """cudnn_split: a causal rank block holding a cut piece runs as two calls a way, the squares top-left causal
    and the cut pieces' rectangles unmasked, each range addressed by its own offsets (the stand-in checks them,
    and that no sequence overlaps another), never on the bottom-right anchor; its results equal the one
    bottom-right call's (the split rule switched off) exactly where the block defines them."""
    g = torch.Generator().manual_seed(5)
    lengths = LAYOUT_LENGTHS.get(layout_name, [1, 0, 13, 6, 1, 11])
    q, k, v, dout, block = _layout_case(layout_name, lengths, 2, 1, True, (-1, -1), g)
    qs, qe, ks, ke = block.ranges
    assert not block.square and bool(((ke - ks > qe - qs) & (qe > qs)).any())  # a cut piece
    if cv.SPLIT_MIN_ROWS:
        pytest.skip("the split rule's row threshold as shipped: these blocks run one call")
    stand_in.graphs.clear()
    split = _through_executor(q, k, v, dout, [block.ranges], encode_varlen([block]), "cudnn_varlen")
    masks = sorted((key[0], key[-3], key[-1]) for key in stand_in.graphs)  # (op, causal, top-left)
    assert masks == [("bwd", False, False), ("bwd", True, True), ("fwd", False, False), ("fwd", True, True)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cv, "splits", lambda window, square, rows=None: False)
        stand_in.graphs.clear()
        one = _through_executor(q, k, v, dout, [block.ranges], encode_varlen([block]), "cudnn_varlen")
        assert sorted((key[0], key[-3], key[-1]) for key in stand_in.graphs) == [
            ("bwd", True, False),
            ("fwd", True, False),
        ]
    used = int(ke.max())
    for i, (a, b) in enumerate(zip(split, one)):
        a, b = (a, b) if i < 3 else (a[:used], b[:used])
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-6, atol=1e-6)


def test_split_rows_that_see_no_key_match_the_one_call(stand_in, stats_form):
    """A causal range with more rows than keys (the contract allows it; no layout makes one): its first rows see no
    key under the bottom-right anchor and lie in neither split call, yet the executor does not mask them (the range
    has keys). The split gives them what one call gives, out 0, lse -inf, dq 0, beside a cut piece and a whole
    document (the review's case, which gave NaN before)."""
    from cpcompile.layouts.thd import VarlenBlock

    g = torch.Generator().manual_seed(6)
    ranges = torch.tensor([[0, 3, 7], [3, 7, 9], [0, 1, 5], [1, 5, 9]])  # 3 rows / 1 key, square 4, cut 2 of 4
    block = VarlenBlock(0, True, ranges, 4, 4, (-1, -1))
    q, k, v, dout = _tensors(g, 9, 9)
    got, want = _both_kernels(q, k, v, dout, block)
    for a, b in zip(got, want):
        assert not a.isnan().any()
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-6, atol=1e-6)
    assert bool((got[1][:, :2] == float("-inf")).all()) and bool((got[0][:2] == 0).all())


@pytest.mark.parametrize("layout_name", ["thd", "thd_zigzag", "thd_balanced"])
def test_a_false_square_claim_changes_the_results(stand_in, layout_name):
    """The check above can fail: the same causal rank blocks, claimed square when they hold a rectangular range
    (a piece that does not start its document), give other outputs on the stand-in than on the reference."""
    g = torch.Generator().manual_seed(4)
    lengths = LAYOUT_LENGTHS.get(layout_name, [1, 0, 13, 6, 1, 11])
    q, k, v, dout, block = _layout_case(layout_name, lengths, 2, 1, True, (-1, -1), g)
    qs, qe, ks, ke = block.ranges
    assert not block.square and bool(((qe - qs != ke - ks) & (qe > qs)).any())
    got, want = _both_kernels(q, k, v, dout, dataclasses.replace(block, square=True))
    assert not torch.allclose(got[0].double(), want[0].double(), atol=1e-3)


def test_graph_keys_do_not_depend_on_the_documents(stand_in):
    """The op builds one graph per key; a layout's block keeps every shape static, so a new batch of documents
    (same packed length, same cu_seqlens length) builds none: what the GPU test checks on the real op."""
    g = torch.Generator().manual_seed(0)
    mixes = {
        "thd": ([5, 11, 3, 13], [20, 1, 1, 10]),
        "thd_zigzag": ([8, 16, 8], [24, 4, 4]),
        "whole": ([5, 11, 16], [2, 2, 28]),
    }
    for name, (first, second) in mixes.items():
        keys = []
        for lengths in (first, second):
            stand_in.graphs.clear()
            q, k, v, dout, block = _layout_case(name, lengths, 2, 1, True, (-1, -1), g, max_doc=28)  # a static bound
            _through_executor(q, k, v, dout, [block.ranges], encode_varlen([block]), "cudnn_varlen")
            keys.append(set(stand_in.graphs))
        calls = 2 if block.square or cv.SPLIT_MIN_ROWS else 4  # a causal block with cut pieces may split in two
        assert keys[0] == keys[1] and len(keys[0]) == calls, name


@pytest.mark.parametrize("strategy", ["thd", "thd_zigzag"])
def test_ring_diagonal_squares_run_top_left_and_equal_the_reference(stand_in, strategy):
    """The ring's step-0 blocks (each local piece against itself: squares, claimed so) through the executor on
    the stand-in: top-left on cuDNN, results equal to cpu_varlen_ref's (thd_zigzag: merged with its unmasked
    back-front block)."""
    from cpcompile.comms.ring.schedule import packed_step_blocks

    g = torch.Generator().manual_seed(6)
    lengths = LAYOUT_LENGTHS["thd_zigzag"] if strategy == "thd_zigzag" else [1, 0, 13, 6, 1, 11]
    cu, local = cu_of(lengths), sum(lengths) // 2
    for rank in range(2):
        blocks = packed_step_blocks(strategy, cu, local, 2, rank, 0, True, max(lengths))
        assert blocks[0].square and not any(b.square for b in blocks[1:])
        q, k, v, dout = _tensors(g, local, local)
        spec, ranges = encode_varlen(blocks), [b.ranges for b in blocks]
        stand_in.graphs.clear()
        kernels = ("cudnn_varlen", "cpu_varlen_ref")
        results = [_through_executor(q, k, v, dout, ranges, spec, kernel) for kernel in kernels]
        assert ("fwd", True) in {(key[0], key[-1]) for key in stand_in.graphs}, "the squares ran top-left"
        for got, want in zip(*results):
            torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-6)
