"""The files of a HF model folder besides its weights and config.json: the tokenizer and
generation_config.json (whose eos ids add to config.json's, and whose sampling fields are
the model's default sampling parameters, as in vLLM)."""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger("jspec")

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


# generation_config.json's sampling fields vLLM takes as a model's default sampling
# parameters (HF's max_new_tokens is vLLM's max_tokens); do_sample is ignored, as vLLM does.
SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def sampling_defaults(generation_config: str, model: str) -> dict:
    """The model creator's default sampling parameters (vLLM's ``generation_config``):
    "auto" reads the model folder's generation_config.json, "vllm" none, any other value is
    a folder holding one. Only the fields it sets, by SamplingParams' names."""
    if generation_config == "vllm":
        return {}
    folder = model if generation_config == "auto" else generation_config
    fn = os.path.join(folder, "generation_config.json")
    if not os.path.exists(fn):
        if generation_config == "auto":
            return {}
        raise ValueError(f"generation_config={generation_config!r}: no generation_config.json in that folder "
                         "(or 'auto': the model's, 'vllm': none)")
    with open(fn) as f:
        cfg = json.load(f)
    out = {k: cfg[k] for k in SAMPLING_FIELDS if cfg.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    if out:
        logger.warning("default sampling parameters from %s: %s (a request's own values take precedence; "
                       "generation_config='vllm' ignores them)", fn, out)
    return out
