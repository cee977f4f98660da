"""Will it fit? The real train step compiled on abstract shapes, measured by XLA.

`planner.py` searches layouts, batches and lengths; `_step.py` builds and compiles
the step of a `PlannedModel`; `_report.py` is what a plan reports.
"""
