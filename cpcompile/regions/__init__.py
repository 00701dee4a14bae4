"""CP regions of the comms not yet in a package (comms/<name>/; ring is there): the plain torch functions the pass
inserts in place of an attention node, one module per comm and family, plus shared pieces (partials, guards,
the DTensor wrapper). comm/registry.py names them."""
