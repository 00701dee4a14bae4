"""comm="ring": K/V shifted around the CP ranks one rank a step while that step's blocks run. dense.py: the
sdpa region (and ring_over, which the hierarchical comm runs across nodes), varlen.py: the packed-document
region, schedule.py: each step's blocks."""
