"""EngineConfig: every engine argument (vLLM's names where vLLM has one), frozen."""

from __future__ import annotations

import dataclasses


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
    max_num_seqs: int = 8
    max_model_len: int | None = None  # None: min(max_position_embeddings, 4096)
    page_size: int = 16
    num_pages: int | None = None  # None: from gpu_memory_utilization (accelerators) or full capacity
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Tokens per step (vLLM's name): decode rows (+ drafts) and prefill chunks together. None:
    # jspec.engine.llm_engine.default_token_budget (2048 when mixing; unmixed, up to 16,384 on
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
    # vLLM's: default sampling parameters from "auto" the model's generation_config.json, "vllm" none, or a folder's.
    generation_config: str = "auto"
