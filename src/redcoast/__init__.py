"""redcoast: automatic tensor and data parallelism for JAX/Equinox models.

Write `collate_fn`, `loss_fn` and `pred_fn`; say how many shards the model is
split into; redcoast builds the mesh, splits every weight, and runs the steps.
"""

from importlib import metadata as _metadata

from . import distributed as distributed
from . import lora as lora
from . import models as models
from . import nn as nn
from . import quant as quant
from . import rl as rl
from . import sampling as sampling
from . import text as text
from . import vision as vision
from ._folders import read_with as _read_with
from .checkpoint._io import Checkpoint as Checkpoint
from .checkpoint._io import CheckpointError as CheckpointError
from .checkpoint._io import latest_checkpoint as latest_checkpoint
from .checkpoint._io import load_checkpoint as load_checkpoint
from .checkpoint._io import save_checkpoint as save_checkpoint
from .distributed._simulated import simulate_devices as simulate_devices
from .models.planning import memory_plan as memory_plan
from .nn import remat as remat
from .parallel import fsdp as fsdp
from .parallel._context_parallel import ContextParallel as ContextParallel
from .parallel._parallelism import Parallelism as Parallelism
from .parallel._ring import context_parallel_attention as context_parallel_attention
from .parallel._sequence import SequenceParallel as SequenceParallel
from .parallel.mesh import make_mesh as make_mesh
from .parallel.place import place as place
from .parallel.place import sharded_init as sharded_init
from .parallel.place import unplace as unplace
from .parallel.sharding import ShardingPlan as ShardingPlan
from .parallel.sharding import sharding_plan as sharding_plan
from .parallel.sharding import sharding_report as sharding_report
from .parallel.sharding import sharding_rules as sharding_rules
from .plan.planner import MemoryPlan as MemoryPlan
from .plan.planner import PlannedModel as PlannedModel
from .quant import quantize as quantize
from .train import preference as preference
from .train.data import Batch as Batch
from .train.data import batches as batches
from .train.data import global_batch_size as global_batch_size
from .train.evaluate import BestMetric as BestMetric
from .train.evaluate import Evaluation as Evaluation
from .train.evaluate import predict as predict
from .train.fit import Checkpointing as Checkpointing
from .train.fit import FitResult as FitResult
from .train.fit import fit as fit
from .train.inference_step import eval_step as eval_step
from .train.inference_step import predict_step as predict_step
from .train.logging import jsonl_logger as jsonl_logger
from .train.logging import median_speed as median_speed
from .train.logging import tensorboard_logger as tensorboard_logger
from .train.logging import wandb_logger as wandb_logger
from .train.loop import Hook as Hook
from .train.loop import LoopState as LoopState
from .train.loop import every as every
from .train.precision import cast as cast
from .train.rollout import Rollout as Rollout
from .train.step import train_step as train_step
from .train.trainable import Trainable as Trainable
from .train.trainable import trainable_mask as trainable_mask
from .train.workdir import WorkdirInUseError as WorkdirInUseError

_read_with(models.from_hf)  # folders the framework reads (the harness's path=) are the zoo's


def __getattr__(name: str) -> object:
    """`rc.eval` (the LM Evaluation Harness on redcoast's model), imported on first use:
    it needs the `eval` extra, which `import redcoast` does not."""
    if name == "eval":
        import importlib

        return importlib.import_module(".eval", __name__)
    raise AttributeError(f"module 'redcoast' has no attribute {name!r}")


try:
    __version__ = _metadata.version("redcoast")
except _metadata.PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0"
