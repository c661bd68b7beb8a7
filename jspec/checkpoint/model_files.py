"""The files of a HF model folder besides its weights and config.json: the tokenizer and
generation_config.json (whose eos ids add to config.json's, and whose sampling fields are
the model's default sampling parameters, as in vLLM)."""

from __future__ import annotations

import logging
import os

from jspec.config import ConfigError, read_json_object

logger = logging.getLogger("jspec")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path, required: bool = False):
    """The folder's Hugging Face tokenizer, or None when it ships none (an error if
    ``required``: a tokenizer folder named by the user)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        if required:
            raise ValueError(f"tokenizer={path!r}: no tokenizer in that folder (none of {list(TOKENIZER_FILES)})")
        return None
    try:
        cls = read_json_object(os.path.join(path, "tokenizer_config.json")).get("tokenizer_class")
    except (OSError, ValueError):  # none, or not a JSON object: AutoTokenizer reads it and says what is wrong
        cls = None
    if cls in FAST_TOKENIZER_CLASSES and os.path.exists(os.path.join(path, "tokenizer.json")):
        # AutoTokenizer's class for these, without AutoTokenizer's imports: they pull in torch
        # (9 s of a server's start on the H200; jspec never runs torch).
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# tokenizer_config.json's tokenizer_class values AutoTokenizer builds as transformers'
# tokenizers-backed base class itself (Llama 3's, jspec's family's)
FAST_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def generation_config_path(folder) -> str:
    return os.path.join(folder, "generation_config.json")


def read_generation_config(folder) -> dict | None:
    """``folder``'s generation_config.json as a dict; None when the folder has none. A
    ConfigError naming the file when it is not a JSON object."""
    fn = generation_config_path(folder)
    return read_json_object(fn) if os.path.exists(fn) else None


def generation_eos(path) -> tuple[int, ...]:
    """eos_token_id of generation_config.json (chat models stop on more than config.json's)."""
    eos = (read_generation_config(path) or {}).get("eos_token_id")
    ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{generation_config_path(path)}: eos_token_id must be an int or a list of ints, "
                          f"got {eos!r}")
    return tuple(ids)


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
    cfg = read_generation_config(folder)
    if cfg is None:
        if generation_config == "auto":
            return {}
        raise ValueError(f"generation_config={generation_config!r}: no generation_config.json in that folder "
                         "(or 'auto': the model's, 'vllm': none)")
    out = {k: cfg[k] for k in SAMPLING_FIELDS if cfg.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    if out:
        logger.warning("default sampling parameters from %s: %s (a request's own values take precedence; "
                       "generation_config='vllm' ignores them)", generation_config_path(folder), out)
    return out
