"""Load any model of the zoo from a Hugging Face folder, the class picked by config.json."""

from pathlib import Path

from jax.sharding import Mesh
from jax.typing import DTypeLike
from jaxtyping import PyTree

from .bart import BART
from .causal_lm import AbstractCausalLM
from .gpt2 import GPT2
from .gptj import GPTJ
from .hf import read_config
from .llama import Llama
from .opt import OPT
from .seq2seq import AbstractSeq2SeqLM
from .t5 import T5

ARCHITECTURES: dict[str, type[AbstractCausalLM] | type[AbstractSeq2SeqLM]] = {
    cls.config_class.model_type: cls for cls in (GPT2, Llama, OPT, GPTJ, T5, BART)
}
"""config.json's `model_type` -> the class that implements it."""


def from_hf(
    path: str | Path,
    *,
    mesh: Mesh | None = None,
    specs: PyTree | None = None,
    fsdp: bool = False,
    dtype: DTypeLike | None = None,
    scan_layers: bool = False,
    vocab_multiple: int = 1,
    remat: str = "none",
) -> AbstractCausalLM | AbstractSeq2SeqLM:
    """Load a `transformers` `save_pretrained` folder as a `GPT2`, `Llama`, `OPT`, `GPTJ`,
    `T5` or `BART`.

    Args:
        path: the folder (config.json + safetensors).
        mesh: place each array on this mesh as it is read (see `HFModel.from_hf`).
        specs: the `PartitionSpec` tree; derived with the sharding rules when omitted.
        fsdp: with derived specs, split the weights over the data axis too (ZeRO-3).
        dtype: cast floating arrays to this dtype (e.g. `jnp.bfloat16`); default: as stored.
        scan_layers: stack the layers and run them with `lax.scan`.
        vocab_multiple: pad the vocabulary to a multiple of this (`128 * n_model_shards`
            splits it evenly, as Megatron-LM does); see `HFModel.from_hf`.
        remat: the blocks' rematerialisation policy (`"none"`, `"dots"`, `"full"`).

    Returns:
        The model, of the class config.json's `model_type` names.

    Raises:
        ValueError: config.json names an architecture redcoast does not implement.

    Example:
        >>> model = rc.models.from_hf("tiny-llama", mesh=rc.make_mesh(2))
    """
    folder = Path(path)
    values = read_config(folder)
    model_type = values.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"config.json in {folder} describes model_type={model_type!r} "
            f"(architectures={values.get('architectures')}), which redcoast does not "
            f"implement; supported model_type values: {sorted(ARCHITECTURES)}."
        )
    return ARCHITECTURES[model_type].from_hf(
        folder,
        mesh=mesh,
        specs=specs,
        fsdp=fsdp,
        dtype=dtype,
        scan_layers=scan_layers,
        vocab_multiple=vocab_multiple,
        remat=remat,
    )
