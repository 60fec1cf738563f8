"""The checkpoint's end-of-sequence token ids, read as transformers reads them.

transformers' ``generate`` stops at ``generation_config.eos_token_id`` — taken from
``generation_config.json`` when the checkpoint has one, else from ``config.json``'s
``eos_token_id`` — and either may be one id or a list of ids. The engine stops at all of them
unless told ``ignore_eos=True``.
"""

from __future__ import annotations

import os
from typing import Any

from .config import read_config_file, read_json

GENERATION_CONFIG_FILE = "generation_config.json"


def _as_ids(value: Any, where: str, vocab_size: int) -> tuple[int, ...]:
    ids = [] if value is None else value if isinstance(value, (list, tuple)) else [value]
    for tok in ids:
        if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < vocab_size:
            raise ValueError(f"{where}: eos_token_id: expected token ids in [0, {vocab_size}), got {value!r}")
    return tuple(dict.fromkeys(ids))  # unique, in the file's order


def eos_token_ids(hf: Any, vocab_size: int) -> tuple[int, ...]:
    """EOS ids of a checkpoint directory (generation_config.json first, then config.json), or
    of a config given as a dict, a transformers config object or a path to config.json."""
    if isinstance(hf, (str, os.PathLike)) and os.path.isdir(hf):
        gen_file = os.path.join(hf, GENERATION_CONFIG_FILE)
        if os.path.isfile(gen_file):
            gen = read_json(gen_file)
            if isinstance(gen, dict) and gen.get("eos_token_id") is not None:
                return _as_ids(gen["eos_token_id"], repr(gen_file), vocab_size)
        where = repr(os.path.join(os.fspath(hf), "config.json"))
    else:
        where = "config"
    config = read_config_file(hf)
    value = config.get("eos_token_id") if isinstance(config, dict) else getattr(config, "eos_token_id", None)
    return _as_ids(value, where, vocab_size)
