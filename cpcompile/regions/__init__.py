"""CP regions: the plain torch functions the pass inserts in place of an attention node, one module per comm
and input kind (dense SDPA, packed varlen_attn), plus the DTensor wrapper. comm/registry.py names them."""
