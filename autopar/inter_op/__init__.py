"""The inter-op planner: layouts of the whole cluster, their estimates, the search over them, and the Plan.

- ``layout``: the knobs of one layout and ``--fix`` parsing;
- ``unit_costs``: per-unit costs on a tensor-parallel group, read off the intra-op ILP;
- ``estimate``: iteration time and memory of a layout (pipeline, data parallelism, ZeRO, recomputation);
- ``search``: every layout of the devices, estimated and ranked;
- ``to_plan``: the chosen layout as a ``Plan``.
"""
