"""How a model is split over devices: the mesh, the rules, placement, and the parallelisms.

`mesh.py` builds the ("data", "model") mesh; `sharding.py` finds a split for every
weight from the traced dataflow (`_dataflow.py`, `_jaxpr.py`, `_tp_rules.py`;
`ShardingPlan` in `_sharding_plan.py`); `place.py` puts a model's arrays on the
mesh (`_placement.py`). What the computation must know of the split is one
`Parallelism` (`_parallelism.py`), active while a step traces (`_active.py`): FSDP's
gathers (`fsdp.py`), sequence parallelism (`_sequence.py`) and context parallelism
(`_context_parallel.py`, its ring attention in `_ring.py`).
"""
