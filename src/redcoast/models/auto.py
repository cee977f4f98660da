"""Load any model of the zoo from a Hugging Face folder, the class picked by config.json."""

from pathlib import Path
from typing import Unpack

from .bart import BART
from .causal_lm import AbstractCausalLM
from .gpt2 import GPT2
from .gptj import GPTJ
from .hf import LoadOptions, check_load_options, read_config
from .llama import Llama
from .opt import OPT
from .seq2seq import AbstractSeq2SeqLM
from .t5 import T5

ARCHITECTURES: dict[str, type[AbstractCausalLM] | type[AbstractSeq2SeqLM]] = {
    cls.config_class.model_type: cls for cls in (GPT2, Llama, OPT, GPTJ, T5, BART)
}
"""config.json's `model_type` -> the class that implements it."""


def from_hf(
    path: str | Path, **options: Unpack[LoadOptions]
) -> AbstractCausalLM | AbstractSeq2SeqLM:
    """Load a `transformers` `save_pretrained` folder as a `GPT2`, `Llama`, `OPT`, `GPTJ`,
    `T5` or `BART`.

    Args:
        path: the folder (config.json + safetensors).
        **options: `mesh`, `specs`, `fsdp`, `dtype`, `scan_layers`, `vocab_multiple`
            and `remat`, each a keyword (see `LoadOptions`), as for `HFModel.from_hf`.

    Returns:
        The model, of the class config.json's `model_type` names.

    Raises:
        ValueError: config.json names an architecture redcoast does not implement.
        TypeError: an option that `LoadOptions` does not name.

    Example:
        >>> model = rc.models.from_hf("tiny-llama", mesh=rc.make_mesh(2))
    """
    check_load_options(options)
    folder = Path(path)
    values = read_config(folder)
    model_type = values.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"config.json in {folder} describes model_type={model_type!r} "
            f"(architectures={values.get('architectures')}), which redcoast does not "
            f"implement; supported model_type values: {sorted(ARCHITECTURES)}."
        )
    return ARCHITECTURES[model_type].from_hf(folder, **options)
