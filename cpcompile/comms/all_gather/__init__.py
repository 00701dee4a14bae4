"""comm="all_gather": every rank gathers every rank's K/V (one all-gather a layer), runs its layout's blocks, and
reduce-scatters the K/V gradient in fp32. dense.py: the sdpa region (its packed key buffer and executor extras are
the ring's and a2a's too), varlen.py: the packed-document region (selective's key buffer and blocks too), flex.py:
the flex_attention region, entry.py: its registry entry."""
