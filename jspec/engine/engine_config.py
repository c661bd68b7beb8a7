"""EngineConfig: every engine argument (vLLM's names where vLLM has one), frozen; its checks
against the model (``checked_max_model_len``) and the token budget it implies."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec import envs
from jspec.engine.logprobs import LOGPROBS_MODES


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None  # vLLM's name: a folder with the tokenizer (None: the model's)
    dtype: str = "auto"  # "auto": the checkpoint's (config.json), else float32 | bfloat16 | float16
    # "auto": the folder's weights; "dummy" (vLLM's name): config.json alone, random weights
    # for target and drafter (benchmarks of shapes with no checkpoint at hand).
    load_format: str = "auto"
    # vLLM's name: None, or the checkpoint's quantization_config method ("fp8" |
    # "compressed-tensors": FP8 weights, read as they are; None takes them too, as vLLM), or
    # "fp8" on an unquantized checkpoint (or load_format "dummy"): the target's projections
    # quantized per output channel as they load. Weight-only (jspec/quantization.py); a
    # drafter is loaded unquantized.
    quantization: str | None = None
    # vLLM's name: "auto" (the model's dtype) or "fp8" / "fp8_e4m3": the target's KV cache in
    # float8_e4m3fn, its scales the checkpoint's (kv_cache_scheme: jspec/checkpoint/kv_scales.py)
    # or 1.0, as vLLM's (a drafter's cache stays in the model's dtype). Half the bytes of a bf16
    # page: twice the pages in the same memory.
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 8
    max_model_len: int | None = None  # None: min(max_position_embeddings, 4096)
    page_size: int = 16
    num_pages: int | None = None  # None: from gpu_memory_utilization (accelerators) or full capacity
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Tokens per step (vLLM's name): decode rows (+ drafts) and prefill chunks together. None:
    # default_token_budget below (2048 when mixing; unmixed, up to 16,384 on
    # an accelerator, a chunk or a decode batch on a CPU).
    max_num_batched_tokens: int | None = None
    max_prefill_chunk: int = 256  # tokens of one prompt per step
    # Mixed steps (jspec/engine/scheduler.py): every decode row (with its drafts), then chunks
    # of at most this many prompts, in one step. 0: a step is all prefill or all decode,
    # prefill first (offline generate's throughput); the server mixes by default
    # (--max-num-partial-prefills 2).
    max_num_partial_prefills: int = 0
    seed: int = 0
    # Kernel choice ("auto" | "reference" | "gpu" | "tpu" | "interpret" | "tpu_interpret"),
    # resolved once by jspec.ops.plan_kernels: "auto" means the Pallas kernels on GPU/TPU and
    # the jnp references on CPU (interpret mode is for checking kernels, far too slow to
    # serve with); JSPEC_KERNEL_IMPL (jspec/envs.py) overrides "auto".
    attn_impl: str = "auto"
    sample_impl: str = "auto"
    # The batch-1 decode glue (fused projections, RoPE + KV write; jspec/ops.py): same
    # choices; GPU kernels only (TPU runs the XLA ops).
    linear_impl: str = "auto"
    speculative_config: dict | None = None
    # Multi-step scheduling (vLLM's name): a stable decode batch with nothing waiting runs
    # this many steps per jit call, tokens fed back on the device. Trades streaming
    # granularity for less host overhead per token. Without speculation only.
    num_scheduler_steps: int = 1
    # Async scheduling (vLLM's name): a decode call is dispatched before the previous one's
    # tokens are read (it starts from them on the device), so the host's bookkeeping for
    # call n runs while the device computes call n + 1. A sequence that stops inside call n
    # has its tokens of call n + 1 discarded. With speculation, the next verification step
    # starts from the bonus token and drafts of the one before, on the device.
    async_scheduling: bool = True
    # Most log-probabilities a request may ask per token (SamplingParams.logprobs /
    # prompt_logprobs; -1: the whole vocabulary), and which (vLLM's names): "raw_logprobs",
    # the model's, or "processed_logprobs", those the sampler draws from.
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    # warmup() also compiles the masked steps of a batch with a grammar (structured outputs),
    # which otherwise compile on first use.
    warmup_structured_outputs: bool = False
    tensor_parallel_size: int = 1  # vLLM's name: devices the model is split over (jspec/parallel)
    # Several hosts (vLLM's names; jspec/parallel/multihost.py): every host runs the same
    # command with its node_rank; the mesh spans their devices, node 0 schedules and serves.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # vLLM's: default sampling parameters from "auto" the model's generation_config.json, "vllm" none, or a folder's.
    generation_config: str = "auto"


def checked_max_model_len(c: EngineConfig, max_position_embeddings: int) -> int:
    """The engine's max_model_len (None: min(max_position_embeddings, 4096)) once ``c``'s
    arguments are checked against the model (config.json's max_position_embeddings): a
    ValueError naming the argument otherwise."""
    if c.max_model_len and c.max_model_len > max_position_embeddings and not envs.JSPEC_ALLOW_LONG_MAX_MODEL_LEN:
        raise ValueError(
            f"max_model_len={c.max_model_len} is greater than the model's max_position_embeddings="
            f"{max_position_embeddings} (config.json): positions past it were never trained. Set "
            f"JSPEC_ALLOW_LONG_MAX_MODEL_LEN=1 (or vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) to allow it"
        )
    if c.page_size < 1 or c.max_num_seqs < 1:
        raise ValueError(f"page_size and max_num_seqs must be >= 1 (got {c.page_size}, {c.max_num_seqs})")
    if c.num_scheduler_steps < 1:
        raise ValueError(f"num_scheduler_steps must be >= 1, got {c.num_scheduler_steps}")
    kv_cache_dtype(c, "float32")  # its own error
    if c.logprobs_mode not in LOGPROBS_MODES or not isinstance(c.max_logprobs, int) or c.max_logprobs < -1:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES} (got {c.logprobs_mode!r}) and "
                         f"max_logprobs an integer >= -1 (got {c.max_logprobs!r})")
    return c.max_model_len or min(max_position_embeddings, 4096)


# vLLM's kv_cache_dtype values jspec takes, each with the cache's dtype (None: the model's)
KV_CACHE_DTYPES = {"auto": None, "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn}


def kv_cache_dtype(c: EngineConfig, dtype):
    """The target's KV cache dtype for a model of ``dtype``: EngineConfig.kv_cache_dtype
    ("auto": ``dtype``; "fp8" / "fp8_e4m3": float8_e4m3fn), or a ValueError naming it."""
    if c.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={c.kv_cache_dtype!r} is not supported (choose from "
                         f"{list(KV_CACHE_DTYPES)}: 'fp8' is e4m3, its scales the checkpoint's or 1.0)")
    return KV_CACHE_DTYPES[c.kv_cache_dtype] or dtype


def fp8_kv_cache(c: EngineConfig) -> bool:
    """Whether the target's KV cache is FP8 (the checkpoint's KV-cache scales then folded in at load)."""
    return KV_CACHE_DTYPES.get(c.kv_cache_dtype) is not None


def default_token_budget(c: EngineConfig, K: int, chunk: int) -> int:
    """max_num_batched_tokens when unset. Mixing: 2048 (vLLM's chunked-prefill default), more
    if max_num_seqs rows of K + 1 tokens and a chunk need it. Unmixed on an accelerator: up to
    16,384 (vLLM's offline default on large GPUs): many prompts' chunks in one step make the
    prefill's matrix products compute-bound (8B on an H200: 512 x 1,024-token prompts
    prefilled in 22.9 s at 256 tokens a step, 12.9 s at 8,192). On a CPU: a chunk or a
    decode batch, the fewest programs to compile."""
    if c.max_num_partial_prefills:
        return max(2048, c.max_num_seqs * (K + 1) + chunk)
    if jax.default_backend() != "cpu":
        return max(chunk, c.max_num_seqs, min(16384, c.max_num_seqs * chunk))
    return max(chunk, c.max_num_seqs)
