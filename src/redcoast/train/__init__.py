"""Training and inference from the three functions: steps, the loop, `fit`, `predict`.

Examples become global batches in `data.py`; `step.py` composes `loss_fn` and an
optimizer into the jitted train step (`precision.py`, `trainable.py` say in what
dtype and which arrays); `inference_step.py` the eval and predict steps;
`loop.py` runs steps with hooks; `fit.py` puts them together with evaluation
(`evaluate.py`, `_evaluator.py`), resuming (`_resume.py`), signals
(`_signals.py`), the workdir's lock (`workdir.py`) and logging (`logging.py`);
`preference.py` holds preference tuning's losses (DPO, IPO, SimPO, ORPO).
"""
