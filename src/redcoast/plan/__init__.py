"""Will it fit? The real train step compiled on abstract shapes, measured by XLA.

`planner.py` searches layouts, batches and lengths; `_step.py` builds and compiles
the step of a `PlannedModel` for a target's devices (`_targets.py`: a TPU slice's,
compiled by the TPU compiler, or this process's); `_hlo.py` and `_flops.py` read the
compiled and the traced program (bytes and FLOPs per run of each loop, collectives,
the CPU's own float32 copies) for the step-time estimate; `_report.py` is what a
plan reports.
"""
