"""vLLM's engine arguments in jspec: one table of those jspec takes under another name,
takes with no setting of its own, takes at vLLM's default value only, or takes at some of
vLLM's values (``CHOICES``: quantization). ``jspec.LLM`` reads it for keyword arguments
and ``python -m jspec.serve`` for flags, so a vLLM user
keeps their keys and flags: each is honoured, or accepted with one log line saying why it
changes nothing here, or refused with an error naming the key and the reason.
"""

from __future__ import annotations

import difflib
import logging

from jspec import quantization
from jspec.engine.engine_config import KV_CACHE_DTYPES

logger = logging.getLogger("jspec")

# vLLM's name -> EngineConfig's.
RENAMED = {
    "block_size": "page_size",
    "num_gpu_blocks_override": "num_pages",
}

# vLLM's dtype names for the ones jspec spells otherwise.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}

# Arguments with nothing to set in jspec, for the reason given (logged when one is passed).
# The value is the argparse type of the server's flag (bool: a switch).
NO_EFFECT = {
    "trust_remote_code": (bool, "jspec runs no code from a checkpoint: its Llama and Qwen3 models are built in"),
    "enforce_eager": (bool, "jspec has no eager mode: every step is a compiled XLA program (enforce_eager "
                            "skips the up-front compile of all shapes: jspec.LLM's warmup=False, the server's "
                            "--warmup off)"),
    "disable_log_stats": (bool, "jspec.LLM logs no periodic statistics (the server logs them; its --disable-log-stats turns them off)"),
    "swap_space": (float, "a preempted request is recomputed from its tokens, never swapped to host memory"),
    "max_seq_len_to_capture": (int, "jspec captures no CUDA graphs: each shape bucket is compiled whole"),
    "disable_custom_all_reduce": (bool, "tensor parallelism's reductions are XLA's collectives"),
    "distributed_executor_backend": (str, "one process drives every device of the mesh (over several hosts: "
                                          "one a host, --nnodes)"),
    "headless": (bool, "a node of --node-rank >= 1 serves no HTTP: it runs node 0's steps"),
    "enable_chunked_prefill": (bool, "prompts are always prefilled in chunks (max_prefill_chunk tokens)"),
}

# Arguments jspec takes at vLLM's default value only: (the flag's type, why no other
# value, the default), in NO_EFFECT's order with the default last.
DEFAULT_ONLY = {
    "pipeline_parallel_size": (int, "jspec splits a model by tensor parallelism only (tensor_parallel_size)", 1),
    "data_parallel_size": (int, "run one jspec server per replica", 1),
    "revision": (str, "jspec loads local folders; no model hub is reached", None),
    "tokenizer_revision": (str, "jspec loads local folders; no model hub is reached", None),
    "download_dir": (str, "jspec loads local folders; no model hub is reached", None),
    "tokenizer_mode": (str, "the tokenizer is the folder's, through transformers' AutoTokenizer", "auto"),
    "cpu_offload_gb": (float, "weights stay on the device", 0),
    "enable_lora": (bool, "jspec serves no LoRA adapters", False),
    "prefix_caching_hash_algo": (str, "the prefix cache's page hashes are sha256 (jspec/engine/block_manager.py)",
                                 "sha256"),
}

# Arguments jspec takes at some of vLLM's values (an EngineConfig field of the same name): (the
# flag's type, the values, what they mean here).
CHOICES = {
    "quantization": (str, (None, *quantization.METHODS),
                     "jspec serves FP8 weights (weight-only): a checkpoint whose quantization_config is "
                     "quant_method 'fp8' or 'compressed-tensors' FP8 (None takes it too), or 'fp8' to quantize "
                     "an unquantized checkpoint's projections as they load"),
    "kv_cache_dtype": (str, tuple(KV_CACHE_DTYPES),
                       "the target's KV cache in the model's dtype ('auto') or float8_e4m3fn ('fp8', 'fp8_e4m3'; "
                       "scales from the checkpoint, else 1.0)"),
}

# The server's flag type of each of vLLM's arguments above (bool: a switch).
FLAGS = {key: entry[0] for key, entry in {**NO_EFFECT, **DEFAULT_ONLY, **CHOICES}.items()}
# A server flag's spelling of None
_NONE = ("", "none", "None")


def note_no_effect(key: str, value, why: str, where: str = "") -> None:
    """The log line of a vLLM argument taken with nothing to set (``where``: the dict it
    came in, e.g. "speculative_config ")."""
    logger.info("%s%s=%r has no effect in jspec: %s", where, key, value, why)


def check_default(key: str, value, default, why: str, where: str = "") -> None:
    """ValueError naming a vLLM argument jspec takes at its default only, given another value."""
    if value != default:
        raise ValueError(f"{where}{key}={value!r} is not supported: {why} (only {default!r})")


def check_supported(engine_args: dict) -> None:
    """ValueError naming the first of vLLM's arguments given at a value jspec cannot honour."""
    for key, value in engine_args.items():
        if key in DEFAULT_ONLY:
            _, why, default = DEFAULT_ONLY[key]
            if not (default is None and value in _NONE):
                check_default(key, value, default, why)
        if key in CHOICES:
            _, values, why = CHOICES[key]
            if value not in values and value not in _NONE:
                raise ValueError(f"{key}={value!r} is not supported: {why} (choose from {list(values)})")


def translate(engine_args: dict, known: set[str]) -> dict:
    """EngineConfig's keyword arguments for ``engine_args`` given by vLLM's or jspec's names
    (``known``: EngineConfig's fields). Raises ValueError naming an unknown key (with the
    nearest known one) or a value jspec cannot honour."""
    check_supported(engine_args)
    out = {}
    for key, value in engine_args.items():
        if key in RENAMED:
            name = RENAMED[key]
            if name in engine_args and engine_args[name] != value:
                raise ValueError(f"{key}={value!r} (vLLM's name for {name}) contradicts {name}={engine_args[name]!r}")
            out[name] = value
        elif key in NO_EFFECT:
            note_no_effect(key, value, NO_EFFECT[key][1])
        elif key in CHOICES:
            out[key] = None if value in _NONE else value
        elif key in known:
            out[key] = value
        elif key not in DEFAULT_ONLY:
            vllm = set(RENAMED) | set(NO_EFFECT) | set(DEFAULT_ONLY) | set(CHOICES)
            near = difflib.get_close_matches(key, sorted(known | vllm), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(f"unknown engine argument {key!r}{hint} (jspec.EngineConfig takes {sorted(known)}, "
                             f"and vLLM's {sorted(vllm)})")
    if "dtype" in out:
        out["dtype"] = DTYPE_ALIASES.get(out["dtype"], out["dtype"])
    return out
