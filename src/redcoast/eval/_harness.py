"""The LM Evaluation Harness's model interface on redcoast's sharded model.

`RedcoastLM` is registered in lm-eval's model registry as `redcoast` when this module
is imported, so `lm_eval.simple_evaluate(model="redcoast", model_args="path=FOLDER")`
finds it (lm-eval finds models only through `register_model` at import time; its
own command line cannot see a model nobody imported: `redcoast eval` is the command-line
form). It tokenizes, truncates and post-processes exactly as the harness's `hf` backend
(`HFLM`) does, and runs the model through `rc.eval.loglikelihoods` and
`rc.eval.continuations`.
"""

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import lm_eval.models  # noqa: F401  (lm-eval's own models, registered before ours)
from jax.sharding import Mesh
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from .._folders import read_folder
from ..parallel.mesh import make_mesh
from ..parallel.place import model_mesh
from ._score import continuations, loglikelihoods

__all__ = ["RedcoastLM", "harness", "harness_metrics"]

_log = logging.getLogger("redcoast.eval")

# What a request's generation kwargs may hold beside `until` and `max_gen_toks`.
_SAMPLING = ("do_sample", "temperature", "top_k", "top_p")


def _tokenizer(given: Any) -> Any:
    """A `transformers` tokenizer, read from the folder `given` names if it is a path."""
    if not isinstance(given, str | Path):
        return given
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(given))


class RedcoastLM(TemplateLM):
    """A redcoast model (on its mesh) and its tokenizer, as the harness's `LM`.

    Args:
        path: a `transformers` checkpoint folder (`to_hf` writes one), loaded with
            `rc.models.from_hf` and split over `n_model_shards` devices; its tokenizer
            too unless `tokenizer` is given.
        model: a zoo decoder instead of `path` (on its mesh, or placed on `mesh`).
        tokenizer: a `transformers` tokenizer or a folder holding one.
        mesh: the mesh to run on; default: the model's, else `make_mesh(n_model_shards)`.
        n_model_shards: devices each copy of the model is split over (with `path`); the
            other devices split the requests.
        fsdp: with `path`, also split the weights over the data axis.
        dtype: with `path`, the weights' dtype (`bfloat16`, ...); scores are float32.
        batch_size: requests per data-parallel device at once (`"auto"`: 8).
        max_batch_size: accepted for `simple_evaluate`, which always passes it; unused.
        device: accepted for `simple_evaluate`; JAX's devices are the mesh's.
        max_length: the most tokens the model reads at once; default: as the `hf`
            backend resolves it (the config's `n_positions`, `max_position_embeddings`
            or `n_ctx`, else the tokenizer's `model_max_length`, else 2048).
        add_bos_token: as the `hf` backend's: whether to add the tokenizer's special
            tokens; default: the tokenizer's own choice.
        progress: report compilations and requests done.

    Example:
        >>> lm_eval.simple_evaluate(model="redcoast",
        ...     model_args="path=runs/finetune/model,n_model_shards=2", tasks=["hellaswag"])
    """

    def __init__(
        self,
        path: str | None = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
        mesh: Mesh | None = None,
        n_model_shards: int = 1,
        fsdp: bool = False,
        dtype: str | None = None,
        batch_size: int | str | None = 8,
        max_batch_size: int | None = None,
        device: str | None = None,
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        progress: bool = False,
    ) -> None:
        super().__init__()
        del max_batch_size, device
        if (path is None) == (model is None):
            raise ValueError(
                "RedcoastLM needs a model: path=FOLDER (a transformers checkpoint) or "
                f"model= (a zoo decoder), not {'both' if path else 'neither'}."
            )
        if path is not None:
            mesh = mesh or make_mesh(int(n_model_shards))
            model = read_folder(path, mesh=mesh, fsdp=bool(fsdp), dtype=dtype)
            tokenizer = tokenizer or path
        if tokenizer is None:
            raise ValueError(
                "RedcoastLM needs the model's tokenizer: tokenizer= (a transformers "
                "tokenizer, or the folder holding it)."
            )
        self.model, self.tokenizer = model, _tokenizer(tokenizer)
        # Generation stops where `transformers`' would: at the config's EOS token(s).
        token_id = getattr(getattr(model, "config", None), "token_id", None)
        self._eos = token_id("eos_token_id") if token_id is not None else None
        self.mesh = mesh or model_mesh(model) or make_mesh(1)
        self.batch_size = 8 if batch_size in (None, "auto") else int(batch_size)
        self.add_bos_token = add_bos_token
        self.progress = bool(progress)
        self._max_length = int(max_length or resolve_max_length(model.config, tokenizer))
        positions = getattr(model, "max_positions", None)
        if positions is not None and self._max_length > positions:
            if max_length:
                raise ValueError(
                    f"max_length={max_length} is longer than the model's {positions} "
                    "positions; give at most that."
                )
            self._max_length = positions

    # ------------------------------------------------------------------ what the harness reads

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return 256

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        del kwargs
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        if add_special_tokens is None and has_bos_prefix(
            string, self.tokenizer.decode(self.prefix_token_id)
        ):
            special = {"add_special_tokens": False}
        return self.tokenizer.encode(string, **special)

    def tok_decode(self, tokens: Sequence[int] | int, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The chat as the tokenizer's template writes it (`--apply_chat_template`), as
        the `hf` backend does: without the system turn where the template refuses one."""
        import jinja2

        how = {"add_generation_prompt": add_generation_prompt}
        how["continue_final_message"] = not add_generation_prompt
        try:
            return self.tokenizer.apply_chat_template(chat_history, tokenize=False, **how)
        except jinja2.exceptions.TemplateError:
            _log.warning("the chat template failed; applying it without the system turn.")
            turns = [m for m in chat_history if m["role"] != "system"]
            return self.tokenizer.apply_chat_template(turns, tokenize=False, **how)

    # ------------------------------------------------------------------ the three requests

    def _run(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh,
            "per_device_batch_size": self.batch_size,
            "progress": self.progress,
        }

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], **kwargs: Any
    ) -> list[tuple[float, bool]]:
        del kwargs
        long = sum(len(c) + len(x) > self.max_length + 1 for _, c, x in requests)
        if long:
            _log.warning(
                "%d of %d requests exceed the model's max_length (%d tokens): their "
                "contexts' first tokens are left out, as the hf backend leaves them out.",
                long,
                len(requests),
                self.max_length,
            )
        pairs = [(context, continuation) for _, context, continuation in requests]
        scores = loglikelihoods(self.model, pairs, max_length=self.max_length, **self._run())
        for (strings, _, _), score in zip(requests, scores, strict=True):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, score)
        return scores

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        del disable_tqdm
        pairs, owner = [], []
        for i, (string,) in enumerate(r.args for r in requests):
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for window in map(make_disjoint_window, windows):
                pairs.append(window)
                owner.append(i)
        scores = loglikelihoods(self.model, pairs, max_length=self.max_length, **self._run())
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, scores, strict=True):
            totals[i] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        del disable_tqdm
        args: list[Any] = [r.args for r in requests]
        groups: dict[str, list[int]] = {}
        for i, (_, gen_kwargs) in enumerate(args):
            groups.setdefault(json.dumps(gen_kwargs, sort_keys=True), []).append(i)
        out: list[str] = [""] * len(requests)
        for indices in groups.values():
            texts = self._generate([args[i][0] for i in indices], args[indices[0]][1])
            for i, text in zip(indices, texts, strict=True):
                out[i] = text
                self.cache_hook.add_partial("generate_until", args[i], text)
        return out

    def _generate(self, contexts: list[str], gen_kwargs: dict[str, Any]) -> list[str]:
        """One group of requests that share their generation kwargs, as `HFLM` runs it."""
        kwargs: dict[str, Any] = dict(normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks))
        until = handle_stop_sequences(
            kwargs.pop("until", None), eos=self.tok_decode(self.eot_token_id, False)
        )
        max_gen_toks = int(kwargs.pop("max_gen_toks"))
        unknown = sorted(set(kwargs) - set(_SAMPLING))
        if unknown:
            raise ValueError(
                f"generation kwargs {unknown} are not supported by redcoast's model; it "
                f"samples with {list(_SAMPLING)} (greedy when do_sample is false)."
            )
        keep = self.max_length - max_gen_toks
        if keep < 1:
            raise ValueError(
                f"max_gen_toks={max_gen_toks} leaves no room for a prompt in the model's "
                f"max_length={self.max_length}; ask for fewer tokens."
            )
        # As `HFLM.tok_batch_encode`: special tokens by the first context, left-truncated.
        special = {} if self.add_bos_token is None else {"add_special_tokens": self.add_bos_token}
        if has_bos_prefix(contexts[0], getattr(self.tokenizer, "bos_token", None)):
            special = {"add_special_tokens": False}
        prompts = [self.tokenizer.encode(c, **special)[-keep:] for c in contexts]
        sample = bool(kwargs.get("do_sample"))
        new = continuations(
            self.model,
            prompts,
            max_new_tokens=max_gen_toks,
            # As the `hf` backend's stopping criteria: the new text, special tokens kept.
            done=lambda tokens: any(s and s in self.tok_decode(tokens, False) for s in until),
            eos_id=self._eos,
            temperature=float(kwargs.get("temperature", 0.0)) if sample else 0.0,
            top_k=kwargs.get("top_k") if sample else None,
            top_p=kwargs.get("top_p") if sample else None,
            **self._run(),
        )
        return [postprocess_generated_text(self.tok_decode(t), until, None) for t in new]


register_model("redcoast")(RedcoastLM)


def harness(
    model: Any,
    tokenizer: Any,
    *,
    mesh: Mesh | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    add_bos_token: bool | None = None,
    progress: bool = False,
) -> RedcoastLM:
    """The harness's `LM` for a model already in hand (the one `fit` returned, say).

    Args:
        model: a zoo decoder, on its mesh or not.
        tokenizer: its `transformers` tokenizer, or the folder holding it.
        mesh, batch_size, max_length, add_bos_token, progress: as for `RedcoastLM`.

    Returns:
        What `lm_eval.simple_evaluate(model=...)` takes.

    Example:
        >>> lm = rc.eval.harness(result.model, "runs/finetune/model")
        >>> lm_eval.simple_evaluate(model=lm, tasks=["redcoast_stdlib_choice"],
        ...                         task_manager=rc.eval.task_manager())
    """
    return RedcoastLM(
        model=model,
        tokenizer=tokenizer,
        mesh=mesh,
        batch_size=batch_size,
        max_length=max_length,
        add_bos_token=add_bos_token,
        progress=progress,
    )


def evaluate(
    lm: RedcoastLM, tasks: list[Any], *, task_manager: Any, seed: int = 0, **options: Any
) -> dict[str, Any]:
    """`lm_eval.simple_evaluate` of `lm` on `tasks`, every seed of the harness `seed`."""
    seeds = ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")
    results = cast(Any, simple_evaluate)(
        model=lm, tasks=tasks, task_manager=task_manager, **dict.fromkeys(seeds, seed), **options
    )
    assert results is not None  # None only on processes other than lm-eval's rank 0
    return results


def harness_metrics(
    tokenizer: Any,
    tasks: Sequence[str | dict[str, Any]],
    *,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    task_manager: Any = None,
    seed: int = 0,
) -> Callable[[Any], dict[str, float]]:
    """`model -> metrics`: the harness's `tasks` scored on a model where it is (on its
    mesh), as `rc.Evaluation(model_fn=...)` runs them inside `fit`.

    Args:
        tokenizer: the model's `transformers` tokenizer, or the folder holding it.
        tasks: task names (redcoast's `TASKS` and lm-eval's own) or task configs.
        limit: documents per task (or a fraction), as `simple_evaluate`'s.
        num_fewshot: examples shown before each question.
        batch_size: requests per data-parallel device at once.
        task_manager: lm-eval's `TaskManager`; default: `task_manager()`.
        seed: the harness's seeds (its few-shot draws, its sampling).

    Returns:
        A function of the model returning `{"task/metric": value}` (the harness's
        numbers, without their standard errors: `redcoast_stdlib_choice/acc`).

    Example:
        >>> score = rc.eval.harness_metrics("runs/finetune/model", ["redcoast"], limit=50)
        >>> rc.fit(..., evaluation=rc.Evaluation(model_fn=score, every=500))
    """
    tokenizer = _tokenizer(tokenizer)
    if task_manager is None:
        from . import task_manager as default_manager

        task_manager = default_manager()

    def metrics(model: Any) -> dict[str, float]:
        lm = harness(model, tokenizer, batch_size=batch_size)
        results = evaluate(
            lm,
            list(tasks),
            task_manager=task_manager,
            seed=seed,
            limit=limit,
            num_fewshot=num_fewshot,
            verbosity="WARNING",
        )
        out = {}
        for task, values in results["results"].items():
            for key, value in values.items():
                name, _, _ = key.partition(",")
                if isinstance(value, int | float) and not name.endswith("_stderr"):
                    out[f"{task}/{name}"] = float(value)
        return out

    return metrics
