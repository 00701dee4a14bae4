"""comm="hierarchical" on a 2-D CP mesh: a2a's exchange inside a node, the ring across the nodes (composed from
comms/a2a and comms/ring). levels.py: a node as one rank of the layout over the nodes, dense.py / varlen.py: the
regions, entry.py: its registry entry (with its bytes per level)."""
