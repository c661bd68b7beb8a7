"""Per-device kernel tuning: the tiles and grid facts the GPU kernels use, by
``jax.Device.device_kind``, as tables (no tile rule lives in a kernel file).

- ``linear`` / ``linear_mma``: tiles of the one-row projection kernels
  (fused_linear.py, qkv_rope_kv_write.py) by weight shape [F, K]: the first row whose
  ``min_k`` / ``min_f`` the shape meets wins. ``linear_mma`` is the tensor-core weight
  stream (bf16 / f16), ``linear`` the elementwise one (any dtype, and the fallback).
- ``attn_*``: paged_attention_gpu.py's fixed choices (its kv splits and warps follow the
  grid size and ``num_sms``).
- ``rejection``: rejection_sampling's GPU statistics kernel.

The rows were measured on the H200 (2026-11-21, scripts/bench_linear.py --sweep,
scripts/bench_attention.py, scripts/bench_rejection.py; figures in the kernels'
docstrings). The H100 SXM has the H200's SMs and a slower memory; its rows are the
H200's, not re-swept. A device not listed takes the H200's rows, with its SM count from
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
    attn_block_kv: int = 64  # keys per inner-loop step of paged attention
    attn_max_block_rows: int = 128  # query rows per program (all rows of a kv head up to this)
    rejection: tuple[int, int, int] = (1, 2, 1)  # (blocks_per_program, num_warps, num_stages)

    def linear_tile(self, F: int, K: int, mma: bool) -> LinearTile:
        for t in self.linear_mma if mma else self.linear:
            if K >= t.min_k and F >= t.min_f:
                return t
        raise AssertionError("a tile table must end with a row for every shape (min_k = min_f = 0)")


# H200 sweep, Llama-3.1-8B layer shapes: K = 4096 (qkv, o) 8 x 512, 4 warps, 4 stages;
# K = 14336 (down) 16 x 1024, 8 warps, 2 stages. Tensor-core stream: down 32 x 512,
# qkv (F >= 6144) 64 x 256 with 4 stages, o 32 x 256.
H200_LINEAR = (LinearTile(8192, 0, 16, 1024, 8, 2), LinearTile(0, 0, 8, 512, 4, 4))
H200_LINEAR_MMA = (LinearTile(8192, 0, 32, 512, 4, 6), LinearTile(0, 6144, 64, 256, 4, 4),
                   LinearTile(0, 0, 32, 256, 4, 6))


def _h200_rows(num_sms: int) -> DeviceTuning:
    return DeviceTuning(num_sms=num_sms, linear=H200_LINEAR, linear_mma=H200_LINEAR_MMA)


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
