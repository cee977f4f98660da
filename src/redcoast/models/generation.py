"""Generation for the zoo's decoders: `rc.sampling.generate`, which any `CausalLM` runs."""

from ..sampling import generate as generate
