"""redcoast: automatic tensor and data parallelism for JAX/Equinox models.

Write `collate_fn`, `loss_fn` and `pred_fn`; say how many shards the model is
split into; redcoast builds the mesh, splits every weight, and runs the steps.
"""

from importlib.metadata import PackageNotFoundError, version

from .mesh import make_mesh as make_mesh
from .sharding import ShardingPlan as ShardingPlan
from .sharding import shard as shard
from .sharding import sharding_plan as sharding_plan
from .sharding import sharding_report as sharding_report
from .sharding import sharding_rules as sharding_rules

try:
    __version__ = version("redcoast")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0"
