"""Text to training rows: tokenize once into a memory-mapped token folder, then pack or pad.

`tokenize` streams files, folders or strings through a checkpoint's own tokenizer
into a token folder written once (`tokens.bin`, the ids; `documents.bin`, where
each document starts; `origins.bin`, the file and line each came from; `meta.json`,
the tokenizer's fingerprint, dtype and counts). `tokenize_instructions` does the
same for prompt/completion or chat records, adding `mask.bin`: which tokens the
loss counts. A folder is built under a temporary name and renamed into place when
complete, so an interrupted run never leaves one that looks finished; a later call
with the same tokenizer and unchanged sources reuses it.

`packed` and `padded` are sequences of fixed-length rows over a token folder
(`{"input_ids": int32[seq_len], "loss_mask": bool[seq_len]}`), read from the
memory map on demand: `fit` and `predict` take them as examples, and each process
reads only the rows of its own devices. `collate` stacks rows into a batch for
`rc.models.lm_loss`.

Reference: Hugging Face's `run_clm.py` (`group_texts` packs the same way: the
token stream cut into blocks of `seq_len`, the remainder dropped).
"""

from ._instructions import tokenize_instructions as tokenize_instructions
from ._rows import PackedRows as PackedRows
from ._rows import PaddedRows as PaddedRows
from ._rows import collate as collate
from ._rows import packed as packed
from ._rows import padded as padded
from ._token_file import TokenFile as TokenFile
from ._tokenize import tokenize as tokenize
from ._tokenizer import Tokenizer as Tokenizer
from ._tokenizer import load_tokenizer as load_tokenizer
