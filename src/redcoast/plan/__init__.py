"""Will it fit? The real train step compiled on abstract shapes, measured by XLA.

`planner.py` searches layouts, batches and lengths; `_step.py` builds and compiles
the step of a `PlannedModel` for a target's devices (`_targets.py`: a TPU slice's,
compiled by the TPU compiler, or this process's); `_hlo.py` reads the compiled
program (bytes per run of each loop, collectives, the CPU's own float32 copies) and
`train.throughput` counts the traced one's FLOPs, for the step-time estimate; `_rl.py`
compiles an RL step's sampler and reference pass beside its train step; `_report.py`
is what a plan reports.
"""
