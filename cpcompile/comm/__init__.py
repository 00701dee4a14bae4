"""What every comm shares: collectives that trace (collectives.py), collectives issued now and waited later
(pending.py), their route (route.py), what a comm's entry holds (entry.py: Comm, Region), what a comm takes
(capabilities.py) and the shape its wire bytes read (wire.py). Nothing here imports a comm package: the comm
packages (comms/) build on these, and comms/registry.py lists them.
"""
