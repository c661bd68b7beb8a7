"""The files of a HF model folder besides its weights and config.json: the tokenizer and
generation_config.json (whose eos ids add to config.json's)."""

from __future__ import annotations

import json
import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path, required: bool = False):
    """The folder's Hugging Face tokenizer, or None when it ships none (an error if
    ``required``: a tokenizer folder named by the user)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        if required:
            raise ValueError(f"tokenizer={path!r}: no tokenizer in that folder (none of {list(TOKENIZER_FILES)})")
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def generation_eos(path) -> tuple[int, ...]:
    """eos_token_id of generation_config.json (chat models stop on more than config.json's)."""
    fn = os.path.join(path, "generation_config.json")
    if not os.path.exists(fn):
        return ()
    with open(fn) as f:
        eos = json.load(f).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
