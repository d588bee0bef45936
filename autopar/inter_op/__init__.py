"""The inter-op planner: layouts of the whole cluster, their estimates, the search over them, and the Plan.

- ``layout``: the knobs of one layout and ``--fix`` parsing;
- ``technique`` and ``techniques``: what a technique gives the planner, and the registry of them; one module per
  technique (``tensor_parallel``, ``tp_overlap``, ``sequence_parallel``, ``recompute``, ``context_parallel``,
  ``pipelining``, ``expert_parallel``, ``data_parallel``), with its rules, unit step and bound terms;
- ``links``: the link of every mesh axis; ``bound``: the search's lower bounds;
- ``unit_costs``: per-unit costs on a tensor-parallel group, read off the intra-op ILP;
- ``estimate``: iteration time and memory of a layout (pipeline, data parallelism, ZeRO, recomputation);
- ``search``: every layout of the devices, estimated and ranked;
- ``to_plan``: the chosen layout as a ``Plan``.
"""
