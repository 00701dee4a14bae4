"""What a Dynamo graph holds that both the pass (find, families/find.py) and the token guard (cpcompile/guard/)
read: which calls are attention (targets.py) and which higher-order ops have bodies, where a body's operands sit
in the call, and how the bodies nest (bodies.py); what a rewritten region call's inputs are, by name
(region_call.py). One table each, so the graphs the pass rewrites are the graphs the guard checks."""
