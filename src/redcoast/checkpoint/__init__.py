"""Checkpoints a user can read without redcoast, written so that nothing is ever lost.

`_io.py` saves and loads (`save_checkpoint`, `load_checkpoint`) in the format of
`_format.py` (safetensors files, `state.json`, checksums), durably (`_durable.py`:
a temporary folder renamed into place); `_run.py` is a run's folder of `step_*`
checkpoints (`Checkpointing`, `latest_checkpoint`, pruning).
"""

from ._io import Checkpoint as Checkpoint
from ._io import CheckpointError as CheckpointError
from ._io import checkpoint_state as checkpoint_state
from ._io import fingerprint as fingerprint
from ._io import latest_checkpoint as latest_checkpoint
from ._io import load_checkpoint as load_checkpoint
from ._io import prune_checkpoints as prune_checkpoints
from ._io import save_checkpoint as save_checkpoint
from ._io import step_checkpoint_path as step_checkpoint_path
from ._run import Checkpointing as Checkpointing
