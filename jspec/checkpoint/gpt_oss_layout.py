"""gpt-oss's expert tensors as its checkpoints hold them -> jspec's MoE layout.

jspec's experts (jspec.models.layers.MoE) are [E, 2I, H] gate rows then up rows, and
[E, H, I] (HF's [out, in] per expert). gpt-oss ships them otherwise:
  - bf16 (transformers' GptOssExperts): ``gate_up_proj`` [E, H, 2I] ([in, out]) with gate
    and up *interleaved* along 2I (gate at even columns, up at odd), its bias
    ``gate_up_proj_bias`` [E, 2I] interleaved alike; ``down_proj`` [E, I, H];
  - MXFP4 (the shipped gpt-oss-20b / 120b): ``<proj>_blocks`` u8[E, out, in / 32, 16], two
    FP4 (e2m1) values a byte, the low nibble first, and ``<proj>_scales`` u8[E, out, in / 32],
    a power of two per 32 values, 2^(scale - 127) (the OCP microscaling format): [out, in]
    already, gate and up rows interleaved.
Each ``LAYOUTS`` entry takes a leaf's source arrays (ParamSpec.sources, in order: floats as
float32, MXFP4 blocks and scales as uint8) and returns the leaf, float32; an MXFP4 entry
returns its blocks and scales, still packed, in our layout (jspec/mxfp4.py keeps them so).
"""

from __future__ import annotations

import numpy as np

from jspec.mxfp4 import FP4_VALUES, MXFP4_BLOCK


def mxfp4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """f32[..., cols] (cols a multiple of 32) -> (blocks u8[..., G, 16], scales u8[..., G]):
    each block's scale the power of two that brings its largest magnitude to at most 6, each
    value rounded to the nearest FP4 value. Tests and benchmarks write MXFP4 checkpoints with it."""
    w = np.asarray(w, np.float32)
    g = w.reshape(w.shape[:-1] + (-1, MXFP4_BLOCK))
    amax = np.abs(g).max(-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int32)
    exp = np.clip(exp, -127, 127)
    scaled = g / np.ldexp(np.float32(1), exp)[..., None]
    codes = np.abs(np.abs(scaled)[..., None] - FP4_VALUES[:8]).argmin(-1).astype(np.uint8)  # magnitude codes 0..7
    codes |= (np.signbit(scaled) & (codes > 0)).astype(np.uint8) << 3
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exp + 127).astype(np.uint8)


def _deinterleave(a: np.ndarray, axis: int) -> np.ndarray:
    """gate | up halves from gate, up interleaved along ``axis``."""
    idx = np.arange(a.shape[axis])
    return np.concatenate([np.take(a, idx[0::2], axis), np.take(a, idx[1::2], axis)], axis)


LAYOUTS = {
    "gpt_oss_gate_up": lambda w: _deinterleave(np.swapaxes(w, 1, 2), 1),  # [E, H, 2I] -> [E, 2I, H]
    "gpt_oss_gate_up_bias": lambda b: _deinterleave(b, 1),  # [E, 2I]
    "gpt_oss_down": lambda w: np.swapaxes(w, 1, 2),  # [E, I, H] -> [E, H, I]
    "mxfp4_gate_up": lambda blocks, scales: (_deinterleave(blocks, 1), _deinterleave(scales, 1)),  # rows
    "mxfp4_down": lambda blocks, scales: (blocks, scales),
}
