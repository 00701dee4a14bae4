"""The cost model's estimates pinned at a few sites of every kind it costs: dense (a 2-D mesh's levels and a measured
point too), windowed dense, packed thd (assumed and given documents, a window), thd_balanced (its plan of the assumed
documents; a measured point). A refactor of the model (how a family supplies its costing) must give exactly these
numbers; a change meant to move them (new rates, a better count) updates them here, on purpose."""

from __future__ import annotations

import pytest
import torch

from cpcompile.comm.wire import LevelBytes
from cpcompile.cost import Costing, Estimate, SiteShape, estimate
from cpcompile.families.sdpa.costing import DENSE
from cpcompile.families.varlen.costing import PACKED


def _shape(costing: Costing, **fields) -> SiteShape:
    """Llama3-8B attention (32 q heads, 8 kv heads, head dim 128, bf16), 4096 tokens a rank on 4 ranks, causal."""
    base = dict(batch=1, tokens=4096, q_heads=32, kv_heads=8, head_dim=128, v_head_dim=128, elt=2, acc_elt=4,
                causal=True, world=4)  # fmt: skip
    return SiteShape(costing, **(base | fields))


DOCS = torch.tensor([0, 3000, 5000, 9000, 12000, 16384])

# fmt: off
CASES = {
    "dense zigzag all_gather": (
        (_shape(DENSE, batch=2), "zigzag", "all_gather", "cudnn", None),
        Estimate(layout='zigzag', comm='all_gather', kernel='cudnn', rates='cudnn', blocks=(4, 5, 5, 4), flops=(3848525578240, 3848525578240, 3848525578240, 3848525578240), compute_ms=(7.2646914436658525, 7.353330355782944, 7.353330355782944, 7.2646914436658525), sent_fwd=100663296, sent_bwd=201326592, wire_ms=1.00663296, documents='', levels=(), measured_ms=None, host_ms=(0.0, 0.0, 0.0, 0.0)),  # noqa: E501
    ),
    "dense hierarchical, 2-D mesh, measured": (  # the ring's step 0 one causal call (ring/schedule.causal_square)
        (_shape(DENSE, world=8, levels=(2, 4)), "zigzag", "hierarchical", "cudnn", None),
        Estimate(layout='zigzag', comm='hierarchical', kernel='cudnn', rates='cudnn', blocks=(2, 2, 2, 2, 2, 2, 2, 2), flops=(3848408137728, 3848408137728, 3848408137728, 3848408137728, 3848408137728, 3848408137728, 3848408137728, 3848408137728), compute_ms=(7.317882724682249, 7.317882724682249, 7.317882724682249, 7.317882724682249, 7.317882724682249, 7.317882724682249, 7.317882724682249, 7.317882724682249), sent_fwd=79691776, sent_bwd=146800640, wire_ms=2.43269632, documents='', levels=(LevelBytes(dim='cp_intra', comm='a2a', fwd=62914560, bwd=62914560), LevelBytes(dim='cp_inter', comm='ring', fwd=16777216, bwd=83886080)), measured_ms=10.1662, host_ms=(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)),  # noqa: E501
    ),
    "windowed dense a2a": (  # 3 blocks, not 9: the descending buffer is reversed (comms/a2a/schedule.ascending)
        (_shape(DENSE, window=(1024, 0)), "zigzag", "a2a", "flash", None),
        Estimate(layout='zigzag', comm='a2a', kernel='flash', rates='flash', blocks=(3, 3, 3, 3), flops=(233229516800, 233229516800, 233229516800, 233229516800), compute_ms=(1.8629422276707077, 1.8629422276707077, 1.8629422276707077, 1.8629422276707077), sent_fwd=62914560, sent_bwd=62914560, wire_ms=0.4194304, documents='', levels=(), measured_ms=None, host_ms=(0.0, 0.0, 0.0, 0.0)),  # noqa: E501
    ),
    "windowed dense ring": (
        (_shape(DENSE, window=(1024, 0)), "zigzag", "ring", "flash", None),
        Estimate(layout='zigzag', comm='ring', kernel='flash', rates='flash', blocks=(3, 4, 4, 2), flops=(210658918400, 240753049600, 240753049600, 240753049600), compute_ms=(1.317987905372811, 1.4200887825597581, 1.4200887825597581, 1.4200887825597581), sent_fwd=33554432, sent_bwd=134217728, wire_ms=0.5592405333333333, documents='', levels=(), measured_ms=None, host_ms=(0.0, 0.0, 0.0, 0.0)),  # noqa: E501
    ),
    "packed thd, assumed documents": (
        (_shape(PACKED, max_doc=3000), "thd", "all_gather", "cudnn_varlen", None),
        Estimate(layout='thd', comm='all_gather', kernel='cudnn_varlen', rates='cudnn_varlen', blocks=(1, 1, 1, 1), flops=(292606705664, 361489235968, 380826550272, 310707224576), compute_ms=(1.1988774282420813, 1.6938172714082955, 1.7987863767751353, 1.6257133008588913), sent_fwd=50331648, sent_bwd=100663296, wire_ms=0.50331648, documents='assumed: documents of 3000 tokens', levels=(), measured_ms=None, host_ms=(0.7709999999999999, 0.7709999999999999, 0.7709999999999999, 0.7709999999999999)),  # noqa: E501
    ),
    "packed thd, given documents, a2a": (
        (_shape(PACKED, max_doc=3000), "thd", "a2a", "flash_varlen", DOCS),
        Estimate(layout='thd', comm='a2a', kernel='flash_varlen', rates='flash_varlen', blocks=(1, 1, 1, 1), flops=(410266501120, 410266501120, 410266501120, 410266501120), compute_ms=(1.9428084405436976, 1.9428084405436976, 1.9428084405436976, 1.9428084405436976), sent_fwd=63307776, sent_bwd=62914560, wire_ms=0.42074112, documents="this batch's 5 documents", levels=(), measured_ms=None, host_ms=(0.0, 0.0, 0.0, 0.0)),  # noqa: E501
    ),
    "packed thd, windowed, ring": (
        (_shape(PACKED, max_doc=3000, window=(512, 0)), "thd", "ring", "flash_varlen", None),
        Estimate(layout='thd', comm='ring', kernel='flash_varlen', rates='flash_varlen', blocks=(1, 3, 3, 3), flops=(105432219648, 112963092480, 106877288448, 111518023680), compute_ms=(0.8830146824750573, 1.9674530002947899, 1.9649634110684386, 1.972868673595603), sent_fwd=16777216, sent_bwd=83886080, wire_ms=0.33554432, documents='assumed: documents of 3000 tokens', levels=(), measured_ms=None, host_ms=(0.0, 0.0, 0.0, 0.0)),  # noqa: E501
    ),
    "thd_balanced selective, lse not read": (
        (_shape(PACKED, max_doc=3000, return_lse=False), "thd_balanced", "selective", "cudnn_varlen", None),
        Estimate(layout='thd_balanced', comm='selective', kernel='cudnn_varlen', rates='cudnn_varlen', blocks=(1, 1, 1, 1), flops=(336389079040, 336415686656, 336412475392, 336412475392), compute_ms=(1.6558494223372942, 1.5129023381863655, 1.5565033965047401, 1.6408714707859928), sent_fwd=36864000, sent_bwd=73728000, wire_ms=0.36864, documents='assumed: documents of 3000 tokens', levels=(), measured_ms=None, host_ms=(0.7709999999999999, 0.7709999999999999, 0.7709999999999999, 0.7709999999999999)),  # noqa: E501
    ),
    "thd_balanced all_gather, measured": (
        (_shape(PACKED, tokens=8192, world=8, max_doc=18288), "thd_balanced", "all_gather", "cudnn_varlen", None),
        Estimate(layout='thd_balanced', comm='all_gather', kernel='cudnn_varlen', rates='cudnn_varlen', blocks=(1, 1, 1, 1, 1, 1, 1, 1), flops=(4004529700864, 4004461232128, 4004529700864, 4004462551040, 4004172791808, 4004571963392, 4004434739200, 4004348264448), compute_ms=(9.750836927169566, 9.765380786258696, 9.750836927169566, 9.635300431497352, 9.415555292621136, 9.577967402834881, 10.015760304598802, 10.000715474109363), sent_fwd=234881024, sent_bwd=469762048, wire_ms=2.34881024, documents='assumed: documents of 18288 tokens', levels=(), measured_ms=14.2049, host_ms=(0.7709999999999999, 0.7709999999999999, 0.7709999999999999, 0.7709999999999999, 0.7709999999999999, 0.7709999999999999, 0.7709999999999999, 0.7709999999999999)),  # noqa: E501
    ),
}
# fmt: on


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_is_pinned(case, monkeypatch):
    monkeypatch.delenv("CPCOMPILE_LINK_GBPS", raising=False)
    monkeypatch.delenv("CPCOMPILE_INTER_GBPS", raising=False)
    args, pinned = CASES[case]
    assert estimate(*args) == pinned
