"""LoRA (Hu et al. 2021, arXiv 2106.09685): train a low-rank update of frozen Linear layers.

`apply` wraps chosen `eqx.nn.Linear` layers of any Equinox model -- a user's own,
or the zoo's projections -- in a `LoRALinear`: the frozen layer plus two small
Linears, `lora_a` (rank x in, random) and `lora_b` (out x rank, zeros), computing
`base(x) + (alpha / rank) * lora_b(lora_a(dropout(x)))`. `W + BA` is never formed
in a step: the update costs two thin matmuls. An `eqx.nn.Embedding` named in the
targets (the zoo's `"embed_tokens"`) becomes a `LoRAEmbedding`, rows of
`W + (alpha / rank) A B`, which a head tied to the table sees too. `trainable` is
the filter that selects the adapters (pass it as `fit(..., trainable=...)`), and
`merge` folds them into plain Linears and tables again; `disabled` switches them off
(the base model, from the same arrays: preference tuning's reference).

The frozen Linear may be quantized first (`rc.quantize(model, targets, "nf4")`:
QLoRA); `apply` wraps it as it wraps a Linear, `trainable` leaves its codes and
scales frozen, and `merge` decodes it.

LoRA knows nothing of sharding: the sharding rules see `lora_a` and `lora_b` as
Linears in the dataflow, and place them with their base (see `rc.sharding_plan`).

`save_peft` and `load_peft` read and write Hugging Face PEFT's adapter folders
(`adapter_config.json`, `adapter_model.safetensors`) for the zoo's models, so an
adapter trained here runs under `peft.PeftModel.from_pretrained` and back.

Example:
    >>> model = rc.lora.apply(model, ["q_proj", "v_proj"], rank=8, key=jax.random.key(0))
    >>> result = rc.fit(model, optax.adamw(1e-3), train, trainable=rc.lora.trainable(model), ...)
    >>> plain = rc.lora.merge(result.model)
"""

from ._layers import LoRAEmbedding as LoRAEmbedding
from ._layers import LoRALinear as LoRALinear
from ._layers import Targets as Targets
from ._layers import apply as apply
from ._layers import disabled as disabled
from ._layers import merge as merge
from ._layers import trainable as trainable
from ._peft import load_peft as load_peft
from ._peft import save_peft as save_peft
