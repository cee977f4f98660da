"""Building blocks any model can use, and that the parallelisms act on.

`dense` runs a Linear (or a module standing for one, `AbstractProjection`) over
every token at once; `AbstractTable` stands for a token table; `normalise` runs a
LayerNorm or RMSNorm with a closed-form gradient; `attention` is scaled
dot-product attention (the score matrix written out, flash-style blocks that never
hold it, or the accelerator's kernels), split over the sequence under context
parallelism; `remat`
recomputes a function in the backward pass; `experts` applies a mixture's experts
to the tokens routed to them; `cross_entropy` scores logits in float32
without a float32 copy of them, and `map_logits` scores a batch's logits a chunk of
tokens at a time. The zoo is written with them, and so
may a user's own model: LoRA wraps what `dense` runs, sequence parallelism splits
it, and `attention` runs over a sequence that `rc.ContextParallel` splits.
"""

from ._attention import IMPLEMENTATIONS as IMPLEMENTATIONS
from ._attention import Implementation as Implementation
from ._attention import attention as attention
from ._attention import check_implementation as check_implementation
from ._experts import experts as experts
from ._layers import AbstractProjection as AbstractProjection
from ._layers import AbstractQuantized as AbstractQuantized
from ._layers import AbstractTable as AbstractTable
from ._layers import Norm as Norm
from ._layers import dense as dense
from ._layers import normalise as normalise
from ._layers import table_dtype as table_dtype
from ._layers import tied_logits as tied_logits
from ._loss import CHUNK_ABOVE as CHUNK_ABOVE
from ._loss import CHUNK_LOGITS as CHUNK_LOGITS
from ._loss import SplitHead as SplitHead
from ._loss import cross_entropy as cross_entropy
from ._loss import map_logits as map_logits
from ._remat import REMAT_POLICIES as REMAT_POLICIES
from ._remat import RematPolicy as RematPolicy
from ._remat import check_remat as check_remat
from ._remat import remat as remat
