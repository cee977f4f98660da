"""Text to training rows: tokenize once into a token folder, then pack or pad.

`tokenize` streams files, folders or strings through a checkpoint's own tokenizer
into a token folder written once (`tokens.bin`, the ids; `documents.bin`, where
each document starts; `origins.bin`, the file and line each came from;
`checksums.bin`, an xxh3-64 of every 1 MiB of `tokens.bin` and `mask.bin`;
`meta.json`, the tokenizer's fingerprint, dtype, counts, the sources'
fingerprints and the small files' checksums). `tokenize_instructions` does the
same for prompt/completion or chat records, adding `mask.bin`: which tokens the
loss counts; `tokenize_preferences` does it for preference pairs (a prompt with a
chosen and a rejected answer), two such documents per pair, which `paired` reads
back as one row (`chosen_ids`, `chosen_mask`, `rejected_ids`, `rejected_mask`).

A folder is built under a temporary name and renamed into place when complete,
so an interrupted run never leaves one that looks finished. A later call reuses
it when the tokenizer and options are the same and so are the sources: each
file's resolved path and size and, when those match, the xxh3-64 of its content
(not its modification time); a list of strings by a hash of them. Only a folder
redcoast wrote, holding nothing else, is ever replaced; anything else at the path
is refused by name. Writers of one folder take turns on an OS lock beside it
(`.<name>.lock`), so two processes tokenizing into one cache both succeed, the
second reusing the first's folder. Files inside token folders are never read as
text, and a list of strings that are all paths of files is refused (strings are
documents: pass `Path`s).

`packed` and `padded` are sequences of fixed-length rows over a token folder
(`{"input_ids": int32[seq_len], "loss_mask": bool[seq_len]}`, and for packed rows
`segment_ids` and `positions` that keep their documents apart), read from disk on
demand with `os.pread`, so a file truncated while in use is an error, never a
crash: each 1 MiB chunk is checked against its checksum the first time a row
touches it (`documents.bin`, `origins.bin` and `checksums.bin` whole when the
folder is opened), and with `model=` every row's ids against its vocabulary.
`fit` and `predict` take them as examples, and each process reads only the rows
of its own devices. `collate` stacks rows into a batch for `rc.models.lm_loss`,
naming the key and row of any that do not fit.

Reference: Hugging Face's `run_clm.py` (`group_texts` packs the same way: the
token stream cut into blocks of `seq_len`, the remainder dropped).
"""

from ._instructions import tokenize_instructions as tokenize_instructions
from ._preference import PairedRows as PairedRows
from ._preference import paired as paired
from ._preference import tokenize_preferences as tokenize_preferences
from ._rows import PackedRows as PackedRows
from ._rows import PaddedRows as PaddedRows
from ._rows import collate as collate
from ._rows import packed as packed
from ._rows import padded as padded
from ._token_file import TokenFile as TokenFile
from ._tokenize import tokenize as tokenize
from ._tokenizer import Tokenizer as Tokenizer
from ._tokenizer import load_tokenizer as load_tokenizer
