"""redcoast: automatic tensor and data parallelism for JAX/Equinox models.

Write `collate_fn`, `loss_fn` and `pred_fn`; say how many shards the model is
split into; redcoast builds the mesh, splits every weight, and runs the steps.
"""

from importlib import metadata as _metadata

from . import distributed as distributed
from . import fsdp as fsdp
from . import lora as lora
from . import models as models
from . import preference as preference
from . import text as text
from ._context import context_parallel_attention as context_parallel_attention
from ._context_parallel import ContextParallel as ContextParallel
from ._seq_parallel import SequenceParallel as SequenceParallel
from ._simulated import simulate_devices as simulate_devices
from .checkpoint import Checkpoint as Checkpoint
from .checkpoint import CheckpointError as CheckpointError
from .checkpoint import latest_checkpoint as latest_checkpoint
from .checkpoint import load_checkpoint as load_checkpoint
from .checkpoint import save_checkpoint as save_checkpoint
from .data import Batch as Batch
from .data import batches as batches
from .data import global_batch_size as global_batch_size
from .evaluate import BestMetric as BestMetric
from .evaluate import Evaluation as Evaluation
from .evaluate import predict as predict
from .fit import Checkpointing as Checkpointing
from .fit import FitResult as FitResult
from .fit import fit as fit
from .inference_step import eval_step as eval_step
from .inference_step import predict_step as predict_step
from .logging import jsonl_logger as jsonl_logger
from .logging import tensorboard_logger as tensorboard_logger
from .logging import wandb_logger as wandb_logger
from .loop import Hook as Hook
from .loop import LoopState as LoopState
from .loop import every as every
from .mesh import make_mesh as make_mesh
from .place import place as place
from .place import sharded_init as sharded_init
from .planner import MemoryPlan as MemoryPlan
from .planner import memory_plan as memory_plan
from .precision import cast as cast
from .rematerialisation import remat as remat
from .sharding import ShardingPlan as ShardingPlan
from .sharding import sharding_plan as sharding_plan
from .sharding import sharding_report as sharding_report
from .sharding import sharding_rules as sharding_rules
from .step import train_step as train_step
from .trainable import Trainable as Trainable
from .trainable import trainable_mask as trainable_mask
from .workdir import WorkdirInUseError as WorkdirInUseError

try:
    __version__ = _metadata.version("redcoast")
except _metadata.PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0"
