"""comm="a2a" (Ulysses): heads traded for sequence by one all-to-all, the whole sequence attended for heads/cp heads,
the output traded back. heads.py: the exchange (shared with hierarchical), schedule.py: the exchanged buffers'
blocks, dense.py / varlen.py / flex.py: the regions per attention family, entry.py: its registry entry."""
