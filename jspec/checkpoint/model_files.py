"""The files of a HF model folder besides its weights and config.json: the tokenizer and
generation_config.json (whose eos ids add to config.json's)."""

from __future__ import annotations

import json
import os


def load_tokenizer(path):
    """The folder's Hugging Face tokenizer, or None when it ships none."""
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
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
