"""The kernel plan: which implementation each op family runs, made once per engine.

``plan_kernels`` turns the platform, the model config and the requested impls
(EngineConfig.attn_impl / linear_impl / sample_impl; JSPEC_KERNEL_IMPL for "auto") into a
frozen ``KernelPlan`` of typed backends (jspec/kernel_backend.py), a static attribute of the
model modules; jspec/ops.py decides per call from it and the call's static shapes.
``plan_params`` puts the weights in the layout the plan's modules declare (``weight_shape``).
"""

from __future__ import annotations

import dataclasses
import os

import jax

from jspec import envs
from jspec.config import ModelConfig
from jspec.kernel_backend import GPU, XLA, Backend, parse_impl, platform_kernels
from jspec.mxfp4 import Mxfp4Weight
from jspec.parallel.mesh import padded_vocab
from jspec.quantization import QuantWeight
from kernels_pallas import fused_linear as _fl
from kernels_pallas import fused_linear_rows as _flr

# Wider projections stay with XLA: gate_up (28672 x 4096) streams at 4.0-4.2 TB/s through
# XLA's autotuned GEMM against 3.9 in fused_linear's kernel (60.3 vs 55.8-58.2 us on the
# H200), more than the RMSNorm kernel it would save (~1.3 us). The lm_head has nothing to fuse.
MAX_KERNEL_FEATURES = 16384


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """Which backend each op family runs (jspec/kernel_backend.py: XLA(), GPU(interpret),
    TPU(interpret)). The default runs XLA everywhere (CPU serving, module tests)."""

    attn: Backend = XLA()  # paged attention
    linear: Backend = XLA()  # batch-1 glue kernels; GPU kernels only (TPU(): XLA)
    sample: Backend = XLA()  # rejection sampling
    # One-row o_proj hands the post-attention RMSNorm to down_proj (linear_then_norm):
    # set by plan_kernels where both projections of the model take the kernel.
    norm_handoff: bool = False
    # Projection weights held [in, out] (plan_params transposes HF's [out, in] once, at
    # load; the modules declare them so through weight_shape). Set by plan_kernels on CPU:
    # XLA:CPU runs a dot of more than one row through YNNPACK, which transposes an [out, in]
    # right operand on every call. In a K=7 DFlash verification step of the family that
    # transpose took 44% of the CPU cycles and the dot itself 15% (perf, 2-vCPU EPYC).
    in_out_weights: bool = False
    # XLA compiler options of the engine's jitted steps (name, value) pairs; set by
    # plan_kernels on CPU (_CPU_XLA_OPTIONS). Compile-time only: the same options on every
    # call, no environment variable.
    xla_options: tuple = ()
    # Tensor parallelism (jspec/parallel): the degree the fused projections' weights are
    # split over (their outputs tp-interleaved: split_fused), the drafter's degree (1: a
    # replicated drafter; for_drafter) and the mesh (per-shard kernels under shard_map).
    # A decoder layer whose KV heads tp divides runs once per device under shard_map
    # (per_shard_layer), with the kernels of ``shard_linear`` on each device's weights and
    # an all-reduce after o_proj and down_proj. Elsewhere (embedding, lm_head, a replicated
    # KV cache) tp > 1 runs the projections and the sampler through XLA, which the SPMD
    # partitioner splits, and the paged-attention kernel per shard of KV heads (attention).
    tp: int = 1
    draft_tp: int = 1
    mesh: object = None  # jax.sharding.Mesh | None
    shard_linear: Backend = XLA()  # ``linear`` inside a per-shard layer (tp > 1)
    # Threads warmup compiles on (jspec/engine/warmup.py, prepare). On an accelerator compilation is
    # host work that releases the GIL (XLA's passes, LLVM, Triton); XLA:CPU's compiler
    # already spreads one compilation over the cores, so CPU compiles one at a time.
    compile_threads: int = 1
    # FP8 weights' XLA GEMMs of more than FP8_GEMM_MIN_ROWS rows quantize their bf16 / f16
    # activations per token and run on FP8 tensor cores (W8A8, vLLM's meaning for a checkpoint
    # with FP8 activations): set by plan_kernels where the checkpoint asks for them
    # (QuantConfig.activations) and the GPU has FP8 tensor cores (fp8_tensor_cores), unless
    # JSPEC_FP8_GEMM=0 (jspec/envs.py).
    fp8_gemm: bool = False
    # XLA options the steps of more than FP8_GEMM_MIN_ROWS tokens compile with besides
    # ``xla_options`` (FlatRunner.compile_options), set by plan_kernels on a GPU. An unquantized model:
    # _GPU_MANY_ROWS_OPTIONS (no autotuning). Under fp8_gemm every FP8 dot there is W8A8, which
    # cuBLASLt's FP8 GEMM serves: XLA's Triton GEMMs stay off in them, whose autotuning over
    # FP8 configurations compiled an 8B step of 16,384 tokens in over 30 s (H200, jax 0.11.2,
    # 2026-11-30, scripts/bench_compile.py), 5-6 s without. Fewer rows keep them: an FP8
    # weight's weight-only dot is a Triton fusion that converts it in the GEMM (dequantized
    # first by cuBLAS's path: 206 us against 34-43).
    many_rows_xla_options: tuple = ()

    @property
    def compiler_options(self) -> dict | None:
        """``jax.jit(..., compiler_options=...)`` for the engine's steps."""
        return dict(self.xla_options) or None

    @property
    def many_rows_options(self) -> dict | None:
        """The compiler options of the steps of more than FP8_GEMM_MIN_ROWS tokens where they
        differ from ``compiler_options`` (None: they do not): ``many_rows_xla_options`` over
        ``xla_options``."""
        return {**dict(self.xla_options), **dict(self.many_rows_xla_options)} if self.many_rows_xla_options else None

    def for_draft_model(self, cfg: ModelConfig) -> KernelPlan:
        """The plan of every drafter: a draft model's (an ordinary Llama / Qwen3 of shape
        ``cfg``), or EAGLE3's, PEagle's or DFlash's layers' (``cfg``: their layer config): a
        target's, the glue kernels included, its norm handoff decided by its own shapes, at
        the drafter's tensor-parallel degree (a replicated one, under a tp > 1 target, on XLA)."""
        linear = self.linear if self.draft_tp == self.tp else XLA()
        return dataclasses.replace(self, linear=linear, norm_handoff=_norm_handoff(linear, cfg), tp=self.draft_tp)


def plan_kernels(cfg: ModelConfig, *, attn_impl: str = "auto", linear_impl: str = "auto",
                 sample_impl: str = "auto", backend: str | None = None, tp: int = 1, draft_tp: int = 1,
                 mesh=None) -> KernelPlan:
    """The engine's plan (made once): each impl name parsed into its backend
    (kernel_backend.parse_impl; a bad name is a ValueError naming its field). "auto":
    JSPEC_KERNEL_IMPL if set (jspec/envs.py), else by backend (kernel_backend.platform_kernels):
    the jnp references on CPU, the GPU / TPU kernels on those backends.
    ``tp`` > 1 (on ``mesh``): outside per-shard layers the glue kernels and the rejection
    kernel give way to XLA, which the SPMD partitioner splits over the mesh (the logits stay
    sharded by vocabulary); inside them (shard_plan) the glue kernels run on each device."""
    backend = backend or jax.default_backend()
    attn, linear, sample = (_resolve(i, name, backend) for i, name in
                            ((attn_impl, "attn_impl"), (linear_impl, "linear_impl"), (sample_impl, "sample_impl")))
    shard_linear = linear
    if tp > 1:
        linear = sample = XLA()
    handoff = _norm_handoff(linear, cfg)
    in_out = backend == "cpu" and not isinstance(linear, GPU)  # the GPU kernels read [out, in] weights
    q = cfg.quantization
    options = _cpu_xla_options() if backend == "cpu" else ()
    threads = 1 if backend == "cpu" else min(8, os.cpu_count() or 1)
    fp8_gemm = bool(envs.JSPEC_FP8_GEMM and backend == "gpu" and q is not None and q.activations and q.block is None
                    and fp8_tensor_cores())
    return KernelPlan(attn=attn, linear=linear, sample=sample, norm_handoff=handoff, in_out_weights=in_out,
                      xla_options=options, tp=tp, draft_tp=draft_tp, mesh=mesh, shard_linear=shard_linear,
                      compile_threads=threads, fp8_gemm=fp8_gemm,
                      many_rows_xla_options=(("xla_gpu_enable_triton_gemm", False),) if fp8_gemm
                      else _GPU_MANY_ROWS_OPTIONS if backend == "gpu" and q is None else ())


# Rows beyond which an FP8 weight's dot may run W8A8 (KernelPlan.fp8_gemm): more than the
# projection kernels take (one row; 2 to MAX_ROWS in fused_linear_rows), where XLA runs a GEMM. On the
# H200 (jax 0.11.2, 2026-11-30, scripts/bench_fp8_gemm.py) the 8B's qkv at 8192 rows took
# 397 us this way (cuBLASLt's FP8 GEMM, the activations' quantization included) against 582
# weight-only (XLA converts the weight, then a bf16 GEMM) and 560 in bf16. Also where the
# steps compiled with many_rows_xla_options begin.
FP8_GEMM_MIN_ROWS = _flr.MAX_ROWS


def fp8_tensor_cores(device=None) -> bool:
    """Whether ``device`` (default: jax's first) has FP8 tensor cores: an NVIDIA GPU of compute
    capability 8.9 (Ada) or later."""
    d = device if device is not None else jax.devices()[0]
    try:
        return d.platform == "gpu" and float(getattr(d, "compute_capability", "0")) >= 8.9
    except ValueError:  # not an NVIDIA capability ("gfx942")
        return False


# XLA:CPU's YNNPACK fusions off: the dots then run on XLA's own (Eigen) path. On the family
# (2-vCPU Xeon, float32, batch 1) a greedy DFlash K=3 step took ~15% less time so, the
# one-row plain step about the same (python -m jspec, 2026-11-25).
_CPU_XLA_OPTIONS = (("xla_cpu_experimental_ynn_fusion_type", ""),)
_cpu_options_checked: tuple | None = None

# An unquantized model's steps of many rows on a GPU: XLA's dots as cuBLAS GEMMs at their
# heuristic algorithms, nothing timed while compiling. XLA's autotuning (Triton GEMM
# configurations and cuBLAS algorithms, each timed on the one GPU) made compiles running on
# warmup's threads wait on each other: the 8B EAGLE3 server's 30 programs took 327 s of
# compiling on 8 threads, warmup 50 s; with none of it 120 s and 32 s (H200, jax 0.11.2,
# 2026-12-01, docs/decisions.md), prefill and decode at 32 / 64 rows as fast or faster. Steps
# of up to FP8_GEMM_MIN_ROWS tokens keep it: with none, batch 1 took 5.26 ms a token against
# 4.17 (likely its one-row lm_head, the only XLA dot there, at cuBLAS's heuristic).
_GPU_MANY_ROWS_OPTIONS = (("xla_gpu_autotune_level", 0), ("xla_gpu_enable_triton_gemm", False))


def _cpu_xla_options() -> tuple:
    """_CPU_XLA_OPTIONS where this jaxlib knows them (an unknown option fails the compile:
    tried once on a one-op function), else none."""
    global _cpu_options_checked
    if _cpu_options_checked is None:
        try:
            jax.jit(lambda x: x + 1, compiler_options=dict(_CPU_XLA_OPTIONS)).lower(1.0).compile()
            _cpu_options_checked = _CPU_XLA_OPTIONS
        except Exception:  # noqa: BLE001  an option this jaxlib does not have
            _cpu_options_checked = ()
    return _cpu_options_checked


def _resolve(impl: str, name: str, backend: str) -> Backend:
    chosen = parse_impl(impl, name)
    if chosen is not None:
        return chosen
    override = envs.JSPEC_KERNEL_IMPL
    if override is not None:
        chosen = parse_impl(override, "JSPEC_KERNEL_IMPL")
    return platform_kernels(backend) if chosen is None else chosen


# ---- weight layout ---------------------------------------------------------------------
def weight_shape(plan: KernelPlan, out_features: int, in_features: int) -> tuple[int, int]:
    """The shape a projection weight (Linear, an lm_head) is held in under ``plan``."""
    return (in_features, out_features) if plan.in_out_weights else (out_features, in_features)


def vocab_rows(plan: KernelPlan, vocab_size: int) -> int:
    """The rows a vocabulary table (an embedding, an lm_head) is held with under ``plan``:
    ``vocab_size`` padded to a multiple of plan.tp (parallel.padded_vocab, as the loader's
    Placement holds it); ``logits`` slices the padded ones off."""
    return padded_vocab(vocab_size, plan.tp)


def plan_params(plan: KernelPlan, params):
    """A loaded parameter tree (HF [out, in] projection weights) in the plan's layout: with
    in_out_weights every projection weight transposed. Projection weights are the 2-D leaves
    named ``weight`` (Linear) and ``lm_head``, an FP8 one (QuantWeight) with its scale;
    embedding tables (``embedding``, ``embed_tokens``) stay [vocab, hidden], as the gathers
    read them."""
    if not plan.in_out_weights:
        return params

    def relayout(path, x):
        return x.T if x.ndim == 2 and path[-1].key in ("weight", "lm_head") else x

    quantized = lambda x: isinstance(x, (QuantWeight, Mxfp4Weight))  # noqa: E731  (leaves of their own)
    return jax.tree_util.tree_map_with_path(relayout, params, is_leaf=quantized)


# ---- RMSNorm travelling into the next projection ---------------------------------------
def _norm_handoff(linear: Backend, cfg: ModelConfig) -> bool:
    """Whether one-row o_proj hands the post-attention norm to down_proj: both take the kernel."""
    return (isinstance(linear, GPU) and not cfg.mlp_bias  # a gate_up bias would be scaled by 1 / rms too
            and _linear_kernel_takes((cfg.hidden_size, cfg.q_size))
            and _linear_kernel_takes((cfg.hidden_size, cfg.intermediate_size)))


def _linear_kernel_takes(w_shape) -> bool:
    return w_shape[0] <= MAX_KERNEL_FEATURES and _fl.supports(1, w_shape)
