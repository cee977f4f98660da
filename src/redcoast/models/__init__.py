"""Equinox models and the blocks they share.

The decoder zoo -- `GPT2`, `Llama`, `OPT`, `GPTJ` -- loads from and saves to Hugging
Face `transformers` folders (`from_hf`, `to_hf`) and generates with a key/value
cache (`generate`). The encoder-decoders `T5` and `BART` do the same, and generate
greedily, by sampling or by beam search (`generate_seq2seq`).
"""

from .auto import ARCHITECTURES as ARCHITECTURES
from .auto import from_hf as from_hf
from .bart import BART as BART
from .bart import BARTConfig as BARTConfig
from .causal_lm import AbstractCausalLM as AbstractCausalLM
from .generation import generate as generate
from .gpt2 import GPT2 as GPT2
from .gpt2 import GPT2Config as GPT2Config
from .gptj import GPTJ as GPTJ
from .gptj import GPTJConfig as GPTJConfig
from .hf import HFConfig as HFConfig
from .hf import HFModel as HFModel
from .hf import MissingTensorError as MissingTensorError
from .layers import MLP as MLP
from .layers import Attention as Attention
from .layers import DecoderBlock as DecoderBlock
from .layers import KVCache as KVCache
from .layers import SwiGLU as SwiGLU
from .layers import activation as activation
from .layers import dense as dense
from .layers import normalise as normalise
from .layers import rotate as rotate
from .llama import Llama as Llama
from .llama import LlamaConfig as LlamaConfig
from .loss import lm_loss as lm_loss
from .loss import next_token_nll as next_token_nll
from .opt import OPT as OPT
from .opt import OPTConfig as OPTConfig
from .presets import PRESETS as PRESETS
from .presets import preset as preset
from .seq2seq import AbstractSeq2SeqLM as AbstractSeq2SeqLM
from .seq2seq import Seq2SeqAttention as Seq2SeqAttention
from .seq2seq_generation import generate_seq2seq as generate_seq2seq
from .t5 import T5 as T5
from .t5 import T5Config as T5Config
