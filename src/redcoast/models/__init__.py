"""Equinox models and the blocks they share."""

from .layers import MLP as MLP
from .layers import Attention as Attention
from .layers import SwiGLU as SwiGLU
from .layers import rotate as rotate
from .tiny import DeepMLP as DeepMLP
from .tiny import TinyGPT as TinyGPT
from .tiny import TinyGPTJ as TinyGPTJ
from .tiny import TinyLlama as TinyLlama
