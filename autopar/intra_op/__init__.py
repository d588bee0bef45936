"""Intra-operator sharding: per-op strategies from DTensor's rules, their costs, and the ILP over them.

- ``strategies``: sharding strategies of every op, from DTensor's own rules;
- ``sharding_costs``: compute, resharding, gradient-sync and memory costs of a strategy;
- ``problem``: the ILP for a slice of the graph on a mesh, solved and read back.
"""
