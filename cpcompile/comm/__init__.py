"""Communication: collectives that trace (collectives.py), the a2a heads<->tokens exchange (heads.py), and the
registry of comms (registry.py: each comm's dense and varlen region and the layouts it takes).

The registry imports the regions, which import collectives and heads; this package's __init__ imports nothing,
so `cpcompile.comm.collectives` can be imported from anywhere without a loop.
"""
