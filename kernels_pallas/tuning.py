"""Per-device kernel tuning: the tiles and grid facts the GPU kernels use, by
``jax.Device.device_kind``, as tables (no tile rule lives in a kernel file).

- ``linear`` / ``linear_mma`` / ``linear_fp8`` / ``linear_fp8_mma``: tiles of the one-row projection kernels
  (fused_linear.py, qkv_rope_kv_write.py, moe_experts.py) by weight shape [F, K]: the first
  row whose ``min_k`` / ``min_f`` the shape meets wins. ``linear_mma`` is the tensor-core
  weight stream (bf16 / f16), for the shapes one of its rows takes; ``linear`` the
  elementwise one (any dtype, every shape, and the rest of bf16 / f16); ``linear_fp8`` the
  elementwise one for FP8 weights, ``linear_fp8_mma`` their float16 tensor-core stream (the
  shapes its rows take), ``linear_fp8_split_k`` that stream split over K (fused_linear_split_k.py).
- ``attn_*``: paged_attention_gpu.py's fixed choices (its kv splits and warps follow the
  grid size and ``num_sms``).
- ``rejection``: rejection_sampling's GPU statistics kernel.

The rows were measured on the H200 (2026-11-21, scripts/bench_linear.py --sweep,
scripts/bench_attention.py, scripts/bench_rejection.py; figures in the kernels'
docstrings), those of narrower weights (F < 4096 or K < 4096) on the H100 (2026-11-27,
below). The H100 SXM has the H200's SMs and a slower memory; it shares the H200's rows. A device not listed takes the H200's rows, with its SM count from
jax when the device reports one (``core_count``). Lookups happen at trace time (static
Python values).
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class LinearTile:
    """A projection tile for weights [F, K] with K >= min_k and F >= min_f."""

    min_k: int
    min_f: int
    block_f: int  # output features per program
    block_d: int  # K chunk per loop step
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class DeviceTuning:
    num_sms: int  # streaming multiprocessors: programs per wave of a grid
    linear: tuple[LinearTile, ...]  # elementwise weight stream
    linear_mma: tuple[LinearTile, ...]  # tensor-core weight stream (bf16 / f16)
    linear_fp8: tuple[LinearTile, ...] = ()  # elementwise stream of FP8 weights (empty: ``linear``'s rows)
    linear_fp8_mma: tuple[LinearTile, ...] = ()  # FP8 weights through float16 tensor-core dots (the shapes listed)
    linear_fp8_split_k: tuple[tuple[int, int, int, LinearTile], ...] = ()  # (F, K, splits, tile): exact shapes
    linear_rows: tuple[LinearTile, ...] = ()  # 2-16 rows (fused_linear_rows.py; bf16 / f16)
    linear_rows_swiglu: tuple[LinearTile, ...] = ()  # ... a gate|up weight with its SwiGLU (block_f: per half)
    # qkv_rope_kv_write.py's tensor-core tile (block_f: rows a program streams, both halves of its
    # RoPE pairs), ahead of the projection's own ``linear_mma`` row
    qkv_rope_mma: tuple[LinearTile, ...] = ()
    qkv_rope_fp8_mma: tuple[LinearTile, ...] = ()  # ... for FP8 weights (float16 dots; the shapes listed)
    attn_block_kv: int = 64  # keys per inner-loop step of paged attention
    attn_max_block_rows: int = 128  # query rows per program (all rows of a kv head up to this)
    rejection: tuple[int, int, int] = (1, 2, 1)  # (blocks_per_program, num_warps, num_stages)
    # moe_experts_mxfp4.py: (block_f rows, block_g blocks of 32 values a step, num_warps,
    # num_stages). H200, 2026-12-01, scripts/bench_moe_mxfp4.py --shape 20b --tiles (one token,
    # top 4; raw docs/bench/2026-12-01_moe_mxfp4_tiles_h200.log): 8 x 16, 3 stages 50.0 us;
    # 16 x 8 x 3 51.9; the first guess 32 x 8 x 2 58.8; 64 x 4 107. With the three-op decode (raw
    # docs/bench/2026-12-01_moe_mxfp4_decode_shift_h200.log): 8 x 16 x 3 48.0, the rest 50.2-60.3.
    # The stream of PTX products and loads a step ahead (raw ..._moe_mxfp4_cuda_stream_h200.log):
    # 8 x 16 x 4 33.3 (1 stage: 33.3), 16 x 16 x 8 35.8, 4 x 32 x 4 36.4, 8 x 32 x 8 37.4.
    moe_mxfp4: tuple[int, int, int, int] = (8, 16, 4, 3)
    # ... through float16 tensor-core dots (moe_experts_mxfp4.py's _row_stream_mma), from
    # ``min_pairs`` (token, expert) pairs up. H200, 2026-12-01, gpt-oss-20b's layer, top 4 (raw
    # docs/bench/2026-12-01_moe_mxfp4_mma_tiles_h200.log): 32 x 8, 2 warps, 3 stages 47.1 us at
    # one token (CUDA cores 47.1), 110.9 / 184.6 at 4 / 8 tokens (146.7 / 278.1); 64 x 8 x 4 x 3
    # 106.7 / 187.3; 16 rows or 16 blocks a step slower. At 2 tokens (8 pairs) 61.4 against 80.7;
    # against the CUDA-core stream of PTX products, 62.0 against 61.5 (at 8 tokens 177.3 / 223.3).
    moe_mxfp4_mma: tuple[int, int, int, int] = (32, 8, 2, 3)
    moe_mxfp4_mma_min_pairs: int = 8

    def linear_tile(self, F: int, K: int, mma: bool, fp8: bool = False) -> LinearTile | None:
        """The first row that takes [F, K]; None where no tensor-core row does (mma). fp8: an
        FP8 weight's stream."""
        table = (self.linear_fp8_mma if fp8 else self.linear_mma) if mma else \
            (self.linear_fp8 + self.linear if fp8 else self.linear)
        for t in table:
            if K >= t.min_k and F >= t.min_f:
                return t
        if mma:
            return None
        raise AssertionError("the elementwise table must end with a row for every shape (min_k = min_f = 0)")

    def split_k_tile(self, F: int, K: int) -> tuple[int, LinearTile] | None:
        """(splits, tile) of the ``linear_fp8_split_k`` row of exactly [F, K], or None."""
        return next(((n, t) for f, k, n, t in self.linear_fp8_split_k if (f, k) == (F, K)), None)

    def qkv_rope_tile(self, F: int, K: int, fp8: bool = False) -> LinearTile | None:
        """The first ``qkv_rope_mma`` (fp8: ``qkv_rope_fp8_mma``) row that takes [F, K], or None
        (then the projection's tile)."""
        table = self.qkv_rope_fp8_mma if fp8 else self.qkv_rope_mma
        return next((t for t in table if K >= t.min_k and F >= t.min_f), None)

    def rows_tile(self, F: int, K: int, swiglu: bool = False) -> LinearTile | None:
        """The first ``linear_rows`` (``linear_rows_swiglu``) row that takes [F, K], or None."""
        table = self.linear_rows_swiglu if swiglu else self.linear_rows
        return next((t for t in table if K >= t.min_k and F >= t.min_f), None)


# H200 sweep, Llama-3.1-8B layer shapes: K = 4096 (qkv, o) 8 x 512, 4 warps, 4 stages;
# K = 14336 (down) 16 x 1024, 8 warps, 2 stages. Tensor-core stream: down 32 x 512,
# qkv (F >= 6144) 64 x 256 with 4 stages, o 32 x 256.
# Narrower weights (H100 sweep, 2026-11-27, scripts/bench_linear.py --sweep --shapes
# qwen3-30b-a3b | llama-1b; docs/bench/2026-11-27_linear_narrow_h100.log): there the
# tensor-core tiles leave SMs idle (o [2048, 4096] at 32 x 256 is 64 programs for 132 SMs)
# and the elementwise stream wins, GPU time per call, old default -> new: Qwen3-30B-A3B qkv
# [5120, 2048] 12.3 -> 9.2 us, o [2048, 4096] 10.3 -> 7.7; Llama-3.2-1B o [2048, 2048]
# 5.9 -> 3.2, down [2048, 8192] 19.7 -> 15.0, qkv [3072, 2048] 7.5 -> 6.4. F < 4096 takes
# 8 x 2048 tiles with 8 warps (256 programs for F = 2048).
H200_LINEAR = (LinearTile(8192, 4096, 16, 1024, 8, 2), LinearTile(0, 4096, 8, 512, 4, 4),
               LinearTile(0, 0, 8, 2048, 8, 4))
# Wider weights (H200, 2026-11-30, scripts/bench_linear.py --shapes llama-70b-tp2 --sweep; raw
# docs/bench/2026-11-30_linear_70b_tp2_h200.log), GPU time per call at K >= 8192: down + SwiGLU
# [8192, 14336] 32 x 256, 4 stages 56.4 us against 65.2 at 32 x 512, 6 stages (bytes: 53.7).
H200_LINEAR_MMA = (LinearTile(8192, 8192, 32, 256, 4, 4), LinearTile(8192, 4096, 32, 512, 4, 6),
                   LinearTile(4096, 6144, 64, 256, 4, 4), LinearTile(4096, 4096, 32, 256, 4, 6))
# FP8 weights, one row (H200, 2026-11-30, scripts/bench_linear.py --fp8 --sweep; raw
# docs/bench/2026-11-30_linear_fp8_h200.log), GPU time per call: the tensor-core stream
# converts each FP8 tile to bf16 on its way to the MMA and lost to the elementwise one at
# every shape (default tiles: qkv 19.4 us, o 13.2, down 37.4); elementwise: qkv [6144, 4096]
# 8 x 512, 4 stages 10.9 us (8 x 1024: 12.1); o [4096, 4096] 8 x 1024 7.5 (16 x 1024: 8.2);
# down [4096, 14336] 16 x 1024, 8 warps 23.7; gate_up [28672, 4096] 8 x 1024 40.7 (8 x 512: 44.2).
H200_LINEAR_FP8 = (LinearTile(8192, 0, 16, 1024, 8, 4), LinearTile(4096, 16384, 8, 1024, 4, 4),
                   LinearTile(4096, 6144, 8, 512, 4, 4), LinearTile(0, 0, 8, 1024, 4, 4))
# FP8 through float16 tensor-core dots (2026-12-01, H200, tiles timed as bench_linear.py --fp8 --sweep
# does; raw docs/bench/2026-12-01_linear_fp8_mma_tiles_h200.log): gate_up [28672, 4096] 128 x 256, 3 stages 30.5 us (64 x 256:
# 31.9; elementwise 40.7, XLA 42.1); the narrower weights stay elementwise (qkv 64 x 256 11.7 against
# 10.9, o 9.5 against 7.5, down 29.2 against 23.6).
# Llama-3.3-70B's widths (2026-12-01, H200, bench_linear.py --fp8 --shapes llama-70b[-tp2] [--sweep]; raw
# docs/bench/2026-12-01_linear_fp8_70b_sweep_h200.log, ..._linear_fp8_70b_tp2_h200.log), first row that takes
# the shape wins: gate_up [57344, 8192] 128 x 256, 4 stages 115.0 us (3 stages, the 8B's row: 143.7; bytes
# 107); its tp-2 shard [28672, 8192] keeps the 8B's row (57.8 against 62.5 at 4 stages); qkv [10240, 8192]
# (fused_linear with its norm; Llama's decode takes qkv_rope_fp8_mma below) 128 x 256, 5 stages 29.4
# (elementwise 34.7, the o row 41.2); o [8192, 8192] 64 x 512, 4 stages 20.4 (elementwise 25.2): o_proj
# hands the next norm over, so it takes this row, not a split over K (19.5); the tp-2 down shard
# [8192, 14336] (+ SwiGLU) takes it too: 35.3 against the elementwise 45.2.
H200_LINEAR_FP8_MMA = (LinearTile(8192, 32768, 128, 256, 4, 4), LinearTile(4096, 16384, 128, 256, 4, 3),
                       LinearTile(8192, 10240, 128, 256, 4, 5), LinearTile(8192, 8192, 64, 512, 4, 4))
# FP8 one row split over K (fused_linear_split_k.py), measured shapes only, (F, K, splits, tile
# of the float16 tensor-core stream); 2026-12-01, H200, scripts/probe_fp8_splitk.py (git history,
# 25f5322; raw docs/bench/2026-12-01_linear_fp8_splitk_probe_h200.log), + residual, XLA's sum
# included: down [4096, 14336] 4 x 64 x 256, 4 stages 18.27 us against the one-pass 22.33
# (S 2: 19.2; elementwise S 4: 21.0); qkv gained 0.5 us, o lost 0.2: neither listed.
# The 70B's down [8192, 28672] (+ SwiGLU; the sweep above): 4 x 128 x 256, 3 stages 57.2 us against
# the one-pass elementwise 85.2 (bytes 53.4).
H200_LINEAR_FP8_SPLIT_K = ((4096, 14336, 4, LinearTile(0, 0, 64, 256, 4, 4)),
                           (8192, 28672, 4, LinearTile(0, 0, 128, 256, 4, 3)))
# 2-16 rows (fused_linear_rows.py), H100 sweep at 16 rows (2026-11-27, scripts/bench_linear.py
# --rows 16 --sweep; docs/bench/2026-11-27_linear_rows_h100.log), GPU time per call: qkv
# [6144, 4096] 32 x 128, 5 stages 19.6 us (32 x 256: 20.2); o [4096, 4096] and down
# [4096, 14336] 32 x 256, 5 stages: 15.6 / 43.6 us; gate_up + SwiGLU [28672, 4096] 64 x 256
# (per half), 3 stages: 80.7 us (16 x 128: 83.5). Narrower weights: untuned.
H200_LINEAR_ROWS = (LinearTile(4096, 6144, 32, 128, 4, 5), LinearTile(4096, 0, 32, 256, 4, 5),
                    LinearTile(0, 0, 16, 256, 4, 4))
# qkv + RoPE + KV write, the same sweep (--qkv-rope-only --sweep): [5120, 8192] at 2 x 32 rows x 512,
# 4 stages 26.3 us against 49.1 at the projection's 2 x 16 rows x 512, 6 stages (bytes: 19.2 us;
# 2 x 16 rows at any depth: 46.7-69.5). The 8B's [6144, 4096] already takes 2 x 32 rows (64 x 256).
H200_QKV_ROPE_MMA = (LinearTile(8192, 4096, 64, 512, 4, 4),)
# ... FP8 weights through float16 dots: the 70B's [10240, 8192] (the sweep above, --fp8) 2 x 64 rows x 256,
# 4 stages 31.1 us against 38.7 at the elementwise 2 x 8 rows x 1024 (bytes 19.1). Narrower FP8 weights
# stay elementwise (the 8B's 2 x 4 rows x 512: kernels_pallas/qkv_rope_kv_write.py).
H200_QKV_ROPE_FP8_MMA = (LinearTile(8192, 8192, 128, 256, 4, 4),)
H200_LINEAR_ROWS_SWIGLU = (LinearTile(4096, 16384, 64, 256, 4, 3), LinearTile(0, 0, 16, 128, 4, 3))


def _h200_rows(num_sms: int) -> DeviceTuning:
    return DeviceTuning(num_sms=num_sms, linear=H200_LINEAR, linear_mma=H200_LINEAR_MMA, linear_fp8=H200_LINEAR_FP8,
                        linear_fp8_mma=H200_LINEAR_FP8_MMA, linear_fp8_split_k=H200_LINEAR_FP8_SPLIT_K,
                        linear_rows=H200_LINEAR_ROWS,
                        linear_rows_swiglu=H200_LINEAR_ROWS_SWIGLU, qkv_rope_mma=H200_QKV_ROPE_MMA,
                        qkv_rope_fp8_mma=H200_QKV_ROPE_FP8_MMA)


# NVIDIA's published SM counts.
DEVICES = {
    "NVIDIA H200": _h200_rows(132),
    "NVIDIA H100 80GB HBM3": _h200_rows(132),
    "NVIDIA H100 NVL": _h200_rows(132),
    "NVIDIA H100 PCIe": _h200_rows(114),
    "NVIDIA A100-SXM4-80GB": _h200_rows(108),
    "NVIDIA A100-SXM4-40GB": _h200_rows(108),
    "NVIDIA A100 80GB PCIe": _h200_rows(108),
    "NVIDIA L4": _h200_rows(58),
}
DEFAULT = DEVICES["NVIDIA H200"]  # the device the rows were measured on


def device_tuning(device=None) -> DeviceTuning:
    """The tuning entry of ``device`` (default: the first device jax sees)."""
    device = device if device is not None else jax.devices()[0]
    kind = getattr(device, "device_kind", "")
    if kind in DEVICES:
        return DEVICES[kind]
    cores = getattr(device, "core_count", None)
    if getattr(device, "platform", "") == "gpu" and isinstance(cores, int) and cores > 0:
        return dataclasses.replace(DEFAULT, num_sms=cores)
    return DEFAULT
