"""A quantized frozen base: QLoRA's NF4 and int8 weights under trainable adapters.

`quantize` replaces chosen `eqx.nn.Linear` layers of any Equinox model with frozen
quantized ones that compute `x @ W^T + b`, decoding `W` inside the computation (in
the input's dtype, bfloat16 or float32) so that no full-precision copy of a weight
outlives its matmul:

- `NF4Linear`: 4-bit NormalFloat with block-wise absmax scales (64 weights a block)
  and double quantization of the scales (8 bits, 256 a block, mean subtracted),
  exactly as QLoRA (Dettmers et al. 2023, arXiv 2305.14314) and bitsandbytes store it;
- `Int8Linear`: int8 with one scale per output channel.

They compose with the rest: `rc.lora.apply` wraps them (QLoRA), `rc.lora.trainable`
leaves their codes and scales frozen, `rc.lora.merge` decodes them back to plain
Linears, the sharding rules split codes and scales with the weight they stand for
(a block never straddles a shard boundary), and
`rc.models.from_hf(..., quantize="nf4")` quantizes each tensor as it is read.

Example:
    >>> model = rc.quantize(model, ["q_proj", "k_proj", "v_proj", "o_proj"], "nf4")
    >>> model = rc.lora.apply(model, ["q_proj", "v_proj"], rank=8, key=jax.random.key(0))
    >>> result = rc.fit(model, optax.adamw(1e-3), train, trainable=rc.lora.trainable(model), ...)
"""

from ._formats import DQ_BLOCK as DQ_BLOCK
from ._formats import DYNAMIC_CODE as DYNAMIC_CODE
from ._formats import NF4_BLOCK as NF4_BLOCK
from ._formats import NF4_CODE as NF4_CODE
from ._layers import FORMATS as FORMATS
from ._layers import Format as Format
from ._layers import Int8Linear as Int8Linear
from ._layers import NF4Linear as NF4Linear
from ._layers import QuantTargets as QuantTargets
from ._layers import check_format as check_format
from ._layers import dequantize as dequantize
from ._layers import quantize as quantize
from ._layers import quantized as quantized
from ._layers import quantized_weight as quantized_weight
