"""LoRA adapters in Hugging Face PEFT's folder format, for models that map to `transformers`.

PEFT names an adapter's tensors after the `transformers` module it adapts
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`). A model that
says how its arrays map to a `transformers` checkpoint -- a `config` and a class
method `hf_tensors(config)` of tensor maps, as the zoo's models have
(`redcoast.models.hf.TensorMap`) -- already says which of its Linears each such
module is, so the names follow from them. PEFT's `lora_A` / `lora_B` are `(r, in)` /
`(out, r)` whatever the base layer's layout (GPT-2's `Conv1D` too), as `lora_a` /
`lora_b` are here.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import PyTree
from safetensors.numpy import load_file, save_file

from .._tree_paths import leaves_with_paths, path_str
from ..distributed._host import to_host
from ..nn import AbstractQuantized
from ._layers import LoRAEmbedding, LoRALinear, adapted_paths, apply, check_alpha, lora_layers

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_AB = {"lora_a": "lora_A", "lora_b": "lora_B"}

# PEFT options that change what an adapter computes, with the value that means
# "plain LoRA"; anything else is refused rather than silently computed otherwise.
_PLAIN = {
    "use_dora": False,
    "use_rslora": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layer_replication": None,
    "trainable_token_indices": None,
    "target_parameters": None,
    "use_qalora": False,
    "alora_invocation_tokens": None,
    "use_bdlora": None,
}


def _modules(model: Any) -> dict[str, tuple[Any, int | None, bool]]:
    """Our Linear path -> (the map of its `transformers` weight, layer, stacked); the
    module of layer `i` is `_module(map, i)`.

    Only per-layer maps of one tensor onto one Linear weight qualify; a fused tensor
    (GPT-2's `c_attn` holds Q, K and V) is absent, and so refused by the callers.
    """
    if not (callable(getattr(type(model), "hf_tensors", None)) and hasattr(model, "config")):
        raise TypeError(
            "PEFT names an adapter's tensors after the transformers module it adapts, so "
            "save_peft/load_peft need a model with a Hugging Face tensor map (a `config` "
            "and a class method `hf_tensors(config)`, as the zoo's GPT2, Llama, OPT, GPTJ "
            f"have); got {type(model).__name__}. Save a custom model's adapters with "
            "rc.save_checkpoint."
        )

    def is_linear(x: Any) -> bool:  # a quantized base (QLoRA) takes adapters as a Linear
        return isinstance(x, eqx.nn.Linear | LoRALinear | AbstractQuantized)

    linears = {path for path, x in leaves_with_paths(model, is_linear) if is_linear(x)}
    out: dict[str, tuple[Any, int | None, bool]] = {}
    for m in type(model).hf_tensors(model.config):  # type: ignore[attr-defined]
        if not m.per_layer or len(m.ours) != 1 or not m.ours[0].endswith(".weight"):
            continue
        linear = m.ours[0][: -len(".weight")]
        blocks = functools.reduce(
            getattr, m.stack.split("."), model
        )  # a part's: `language_model.blocks`
        if isinstance(blocks, tuple):
            for i in range(len(blocks)):
                out[f"{m.stack}.{i}.{linear}"] = (m, i, False)
        else:
            out[f"{m.stack}.{linear}"] = (m, None, True)
    return {path: v for path, v in out.items() if path in linears}


def _module(model: Any, m: Any, i: int | None) -> str:
    """The `transformers` module whose weight the tensor map `m` maps (a
    `redcoast.models.hf.TensorMap`), in layer `i` of its stack: named as the module
    transformers' class holds it (`hf_module`), which is what PEFT names."""
    return _live(model, m.name(i)).removesuffix(".weight")


def _live(model: Any, name: str) -> str:
    """A checkpoint's tensor name as transformers' modules hold it (a LLaVA's
    `language_model.model.` is `model.language_model.`)."""
    rename = getattr(type(model), "hf_module", None)
    return name if rename is None else rename(name)


def _uniform(layers: list[tuple[str, LoRALinear]]) -> tuple[int, float, float]:
    """The rank, scale and dropout every layer shares (PEFT's config holds one of each)."""
    kinds = {(x.rank, x.scale, float(x.dropout.p)) for _, x in layers}
    if len(kinds) != 1:
        raise ValueError(
            "save_peft writes one rank, lora_alpha and lora_dropout for every layer, but "
            f"the model's LoRA layers differ: (rank, alpha/rank, dropout) in {sorted(kinds)}."
        )
    return kinds.pop()


def _transposed(model: Any) -> bool:
    """Whether the checkpoint stores Linears `(in, out)` (GPT-2's Conv1D): PEFT's fan_in_fan_out."""
    for m in type(model).hf_tensors(model.config):
        if m.per_layer and len(m.ours) == 1 and m.ours[0].endswith("proj.weight"):
            return m.to_ours(np.zeros((2, 3)))[0].shape == (3, 2)
    return False


def save_peft(
    model: PyTree, folder: str | os.PathLike[str], *, base_model_name_or_path: str | None = None
) -> Path:
    """Write a zoo model's LoRA adapters as a PEFT folder `peft.PeftModel.from_pretrained` reads.

    Args:
        model: a zoo model (`GPT2`, `Llama`, ...) with `LoRALinear` layers of one
            rank, alpha and dropout, on per-layer projections.
        folder: created if missing; gets `adapter_config.json` and
            `adapter_model.safetensors` (float32).
        base_model_name_or_path: recorded in the config, as PEFT does.

    Returns:
        The folder.

    Raises:
        TypeError: `model` is not a zoo model.
        ValueError: no LoRA layers, layers of different ranks or alphas, a LoRA
            layer with no `transformers` module of its own (GPT-2's Q, K and V are
            one fused `c_attn` there; the vocabulary head), or an adapted table
            (`LoRAEmbedding`).

    Example:
        >>> rc.lora.save_peft(result.model, "adapter")
        >>> peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), "adapter")
    """
    tables = [
        p
        for p, x in leaves_with_paths(model, lambda x: isinstance(x, LoRAEmbedding))
        if isinstance(x, LoRAEmbedding)
    ]
    if tables:
        raise ValueError(
            f"save_peft writes the adapters of Linears, and {tables} adapt an embedding "
            "table. Fold them into the model with rc.lora.merge and save that with to_hf, "
            "or leave the tables out of rc.lora.apply's targets."
        )
    layers = lora_layers(model)
    if not layers:
        raise ValueError("save_peft: the model has no LoRA layers; use rc.lora.apply first.")
    modules = _modules(model)
    missing = [p for p, _ in layers if p not in modules]
    if missing:
        raise ValueError(
            f"save_peft: {missing[:4]} have no transformers module of their own, so PEFT "
            "cannot name their adapters (GPT-2 fuses Q, K and V into one c_attn, which PEFT "
            "adapts with one shared A). Leave them out of rc.lora.apply's targets, or "
            f"merge them (rc.lora.merge). Supported here: {sorted(modules)[:6]} ..."
        )
    rank, scale, dropout = _uniform(layers)
    tensors: dict[str, np.ndarray] = {}
    for path, layer in layers:
        module, index, stacked = modules[path]
        for ours, theirs in _AB.items():
            weight = np.asarray(to_host(getattr(layer, ours).weight), np.float32)
            rows = enumerate(weight) if stacked else [(index, weight)]
            for i, w in rows:
                tensors[f"{_PREFIX}{_module(model, module, i)}.{theirs}.weight"] = w
    targets = sorted({k[len(_PREFIX) :].rsplit(".", 2)[0] for k in tensors})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": scale * rank,
        "lora_dropout": dropout,
        "target_modules": targets,
        "fan_in_fan_out": _transposed(model),
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        **_PLAIN,
    }
    out = Path(folder)
    if jax.process_index() == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / WEIGHTS))
        (out / CONFIG).write_text(json.dumps(config, indent=2))
    return out


def _check_config(config: dict[str, Any], path: Path) -> None:
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not 'LORA'.")
    odd = {
        k: config[k]
        for k, plain in _PLAIN.items()
        if config.get(k, plain) not in (plain, None, False, {}, [])
    }
    if odd:
        raise ValueError(
            f"{path}: PEFT options {odd} are not supported: rc.lora computes plain LoRA "
            f"({', '.join(f'{k}={v!r}' for k, v in _PLAIN.items())}). Train the adapter "
            "without them, or merge it in PEFT (merge_and_unload) and load the merged model."
        )


def load_peft(
    model: PyTree, folder: str | os.PathLike[str], *, dtype: DTypeLike = jnp.float32
) -> PyTree:
    """A zoo model with the LoRA adapters of a PEFT folder applied to it.

    Args:
        model: the base model (a zoo model without LoRA layers), e.g. from
            `rc.models.from_hf` of the checkpoint the adapter was trained on.
        folder: a PEFT `save_pretrained` folder of a LoRA adapter.
        dtype: of the loaded `lora_a` / `lora_b`.

    Returns:
        The model with `LoRALinear` layers holding the adapter.

    Raises:
        ValueError: the model already has LoRA layers; the config asks for something
            other than plain LoRA (DoRA, rsLoRA, biases, per-layer ranks,
            modules_to_save, ...) or its `lora_alpha` is not a finite number > 0; a
            tensor names a module the model has no Linear for; a module of the model
            that the config's `target_modules` (and `layers_to_transform`) select has
            no tensors in the file (an adapter of a shallower model); or shapes
            disagree.

    Example:
        >>> model = rc.lora.load_peft(rc.models.from_hf("llama-base"), "adapter")
    """
    root = Path(folder)
    adapted = adapted_paths(model)
    if adapted:
        raise ValueError(
            f"load_peft: the model already has LoRA adapters at {adapted[:6]}"
            f"{' ...' if len(adapted) > 6 else ''}, and load_peft adds an adapter to a "
            "base model. Load onto the base model, or fold the adapters in first with "
            "rc.lora.merge and load onto the merged model."
        )
    config = json.loads((root / CONFIG).read_text())
    _check_config(config, root / CONFIG)
    rank = int(config["r"])
    alpha = check_alpha(config.get("lora_alpha"), f"{root / CONFIG}: lora_alpha")
    dropout = float(config.get("lora_dropout") or 0.0)
    # Adapters saved before transformers 5 name some modules as the checkpoint does.
    tensors = {
        _PREFIX + _live(model, k.removeprefix(_PREFIX)): v
        for k, v in load_file(str(root / WEIGHTS)).items()
    }
    modules = _modules(model)
    by_name = {
        _module(model, module, i): (path, i, stacked)
        for path, (module, i, stacked) in modules.items()
        for i in ([i] if not stacked else range(_layers(model, path)))
    }
    found = _adapters_by_path(tensors, model, by_name, root / WEIGHTS)
    _check_covered(config, by_name, tensors, model, root)
    wrapped = apply(
        model,
        lambda p, _: p in found,
        rank=rank,
        alpha=alpha,
        dropout=dropout,
        dtype=dtype,
        key=jax.random.key(0),
    )

    def fill(path: str, layer: Any) -> Any:
        if not isinstance(layer, LoRALinear) or path not in found:
            return layer
        return _filled(layer, path, found[path], modules[path][2], dtype, root / WEIGHTS)

    flat, treedef = jax.tree_util.tree_flatten_with_path(
        wrapped, is_leaf=lambda x: isinstance(x, LoRALinear)
    )
    return jax.tree_util.tree_unflatten(treedef, [fill(path_str(p), x) for p, x in flat])


def _split_key(key: str) -> tuple[str, str]:
    """A PEFT tensor's name -> (the `transformers` module it adapts, `lora_A` or `lora_B`)."""
    parts = key.removeprefix(_PREFIX).rsplit(".", 2)
    if len(parts) != 3:  # not `module.lora_X.weight`: named as no module we know
        return key, ""
    # PEFT drops the adapter's name on save; a folder written by hand may keep it.
    return parts[0].removesuffix(".default"), parts[1]


def _adapters_by_path(
    tensors: dict[str, np.ndarray],
    model: PyTree,
    by_name: dict[str, tuple[str, int | None, bool]],
    file: Path,
) -> dict[str, dict[tuple[str, int | None], np.ndarray]]:
    """A PEFT file's tensors by our Linear path: `(lora_a | lora_b, layer or None)` -> tensor."""
    found: dict[str, dict[tuple[str, int | None], np.ndarray]] = {}
    for key, value in tensors.items():
        module, which = _split_key(key)
        if module not in by_name or which not in _AB.values():
            raise ValueError(
                f"{file}: {key!r} names no projection of {type(model).__name__} "
                f"that redcoast can adapt (known: {sorted(by_name)[:4]} ...)."
            )
        path, i, stacked = by_name[module]
        ours = "lora_a" if which == "lora_A" else "lora_b"
        found.setdefault(path, {})[(ours, i if stacked else None)] = value
    return found


def _targeted(config: dict[str, Any], name: str) -> bool:
    """Whether PEFT adapts the `transformers` module `name` under `config`, as PEFT's
    `check_target_module_exists` decides it (0.21)."""
    exclude = config.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, name):
                return False
        elif name in exclude or any(name.endswith(f".{e}") for e in exclude):
            return False
    targets = config["target_modules"]
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, name) is not None
    if name in targets:
        return True
    if not any(name.endswith(f".{t}") for t in targets):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    # The layer index is the first numbered part of the name, after `layers_pattern`.
    pattern = config.get("layers_pattern")
    regexes = (
        [r".*?\.[^.]*\.(?P<idx>\d+)\."]
        if not pattern
        else [
            rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\."
            for p in ([pattern] if isinstance(pattern, str) else pattern)
        ]
    )
    for regex in regexes:
        match = re.match(regex, name)
        if match:
            index = int(match["idx"])
            return index == layers if isinstance(layers, int) else index in layers
    return False


def _check_covered(
    config: dict[str, Any],
    by_name: dict[str, tuple[str, int | None, bool]],
    tensors: dict[str, np.ndarray],
    model: Any,
    root: Path,
) -> None:
    """Refuse an adapter that leaves a module its config targets without tensors.

    An adapter of a 2-layer model has no tensors for a 3-layer base's last layer,
    which its `target_modules` still select: loading it would leave that layer plain.
    """
    if config.get("target_modules") is None:  # nothing to tell targeted modules by
        return
    present: dict[str, set[str]] = {}
    for key in tensors:
        module, which = _split_key(key)
        present.setdefault(module, set()).add(which)
    missing = [
        name
        for name in by_name
        if _targeted(config, name) and not set(_AB.values()) <= present.get(name, set())
    ]
    if missing:
        selected = {
            k: config[k]
            for k in ("target_modules", "layers_to_transform", "exclude_modules")
            if config.get(k) is not None
        }
        raise ValueError(
            f"{root}: the adapter's config selects {len(missing)} module(s) of "
            f"{type(model).__name__} that its {WEIGHTS} holds no lora_A and lora_B for: "
            f"{missing[:6]}{' ...' if len(missing) > 6 else ''} ({CONFIG}: {selected}). "
            "Loaded here they would stay plain, where PEFT adapts them: the adapter was "
            "trained on another architecture (fewer layers?). Load it onto the model it "
            "was trained on."
        )


def _filled(
    layer: LoRALinear,
    path: str,
    pieces: dict[tuple[str, int | None], np.ndarray],
    stacked: bool,
    dtype: DTypeLike,
    file: Path,
) -> LoRALinear:
    """`layer` with the adapter's `lora_a` and `lora_b`, stacked per layer when scanned."""
    arrays = []
    for ours in ("lora_a", "lora_b"):
        like = getattr(layer, ours).weight
        wanted = list(range(like.shape[0])) if stacked else [None]
        absent = [i for i in wanted if (ours, i) not in pieces]
        if absent:
            raise ValueError(
                f"{file}: {path}'s {_AB[ours]} is missing for layer(s) {absent}, and an "
                "adapter on scanned layers (scan_layers=True) must cover every layer. Load "
                "it onto the model built with scan_layers=False."
                if stacked
                else f"{file}: {path} has a {_AB['lora_b' if ours == 'lora_a' else 'lora_a']} "
                f"but no {_AB[ours]}: the file is incomplete."
            )
        got = np.stack([pieces[(ours, i)] for i in wanted]) if stacked else pieces[(ours, None)]
        if got.shape != like.shape:
            raise ValueError(
                f"{file}: {path}'s {_AB[ours]} has shape {got.shape}, the model "
                f"needs {like.shape}: the adapter was trained on another architecture."
            )
        arrays.append(jnp.asarray(got, dtype))
    return eqx.tree_at(lambda m: (m.lora_a.weight, m.lora_b.weight), layer, tuple(arrays))


def _layers(model: Any, path: str) -> int:
    """How many layers the stacked Linear at `path` holds."""
    node = model
    for part in path.split("."):
        node = getattr(node, part)
    shape = node.weight_shape if isinstance(node, AbstractQuantized) else node.weight.shape
    return int(shape[0])
