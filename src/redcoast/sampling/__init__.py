"""Sampling from a causal language model: many completions per prompt, on a sharded model.

`sample` continues each prompt of a batch `num_samples` times (GRPO's group): each
prompt goes through the model once and its key/value cache is shared by its samples;
the steps then sample with temperature, top-k, top-p and min-p (in `transformers`'
order) and stop as soon as every row has produced `eos_id`; outside a trace, rows
that have ended are dropped from the batch as it halves. `generate` is the one
continuation per prompt of `rc.models.generate`. Both run on any model with a cached
forward pass (`CausalLM`: every decoder of the zoo, or a model of your own), placed
on a mesh or not; the same key draws the same tokens on one device and on any mesh.
Each shape compiles its own program: `pad_prompts` pads a batch to a few lengths.

The files: the protocol (`_protocol.py`), the filters and the draw (`_warpers.py`),
the compiled loop and its batch halving (`_loop.py`), the public functions and their
checks (`_sample.py`), the length buckets (`_buckets.py`).

Example:
    >>> ids, lengths = rc.sampling.pad_prompts(prompts, max_length=2048 - 256)
    >>> out = rc.sampling.sample(model, ids, prompt_lengths=lengths, num_samples=8,
    ...                          max_new_tokens=256, temperature=1.0, min_p=0.05,
    ...                          eos_id=tokenizer.eos_token_id, key=key)
    >>> out.tokens[b * 8 + g, : out.lengths[b * 8 + g]]    # sample g of prompt b
"""

from ._buckets import bucket_length as bucket_length
from ._buckets import pad_prompts as pad_prompts
from ._protocol import CausalLM as CausalLM
from ._sample import Samples as Samples
from ._sample import generate as generate
from ._sample import sample as sample
