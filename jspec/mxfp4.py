"""MXFP4 weights kept packed on the device: gpt-oss's experts as its checkpoints ship them.

The OCP microscaling format (jspec/checkpoint/gpt_oss_layout.py reads it from the files):
each run of 32 values along a row shares a power-of-two scale 2^(s - 127) (``scales``,
u8[..., G]) and each value is an FP4 (e2m1) code, two a byte, the low nibble first
(``blocks``, u8[..., G, 16]). 4.25 bits a weight, where bf16 takes 16: the experts of
gpt-oss-120b are ~61 GB packed and ~230 GB in bf16, more than one GPU holds.

``Mxfp4Weight`` is a leaf of the parameter tree (a stacked-experts weight [E, rows, cols],
HF [out, in] per expert, in every plan); jspec/ops_moe.py dequantizes the experts it
gathers (``take``) through XLA, or streams them packed through
kernels_pallas/moe_experts_mxfp4.py on the GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kernels_pallas.moe_experts_mxfp4 import BLOCK as MXFP4_BLOCK  # values sharing one scale
from kernels_pallas.moe_experts_mxfp4 import dequantize

# e2m1: sign, two exponent bits, one mantissa bit (the OCP MX spec's FP4 values)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


@struct.dataclass
class Mxfp4Weight:
    """``blocks`` u8[..., rows, G, 16] and ``scales`` u8[..., rows, G]: the weight
    [..., rows, G * 32] (``shape``), dequantized to ``dtype``. The first leaf is ``blocks``:
    Flax checks its shape against the module's declared one (jspec.models.layers.MoE)."""

    blocks: jax.Array  # u8[..., rows, G, 16]: FP4 codes, value 2j in the low nibble of byte j, 2j + 1 in the high
    scales: jax.Array  # u8[..., rows, G]: each block's exponent, biased by 127
    dtype: str = struct.field(pytree_node=False, default="float32")  # the compute dtype it dequantizes to

    @property
    def shape(self):
        return self.scales.shape[:-1] + (self.scales.shape[-1] * MXFP4_BLOCK,)

    @property
    def ndim(self):
        return self.scales.ndim

    def dequantize(self) -> jax.Array:
        """[..., rows, cols] in ``dtype``: every FP4 value times its block's power of two,
        exact in float32 and in bfloat16 (an FP4 value has 2 significant bits; a block
        scale of 0, 2^-127, reads as 0)."""
        return dequantize(self.blocks, self.scales, self.dtype)

    def take(self, idx) -> Mxfp4Weight:
        """The stacked experts ``idx`` (axis 0), still packed."""
        return Mxfp4Weight(jnp.take(self.blocks, idx, axis=0), jnp.take(self.scales, idx, axis=0), self.dtype)


def declared(key, shape, dtype) -> Mxfp4Weight:
    """A Flax initializer's stand-in: zeros of the packed shapes of a [..., rows, cols] weight
    (what ``Module.param`` checks a loaded leaf's shapes against; never trained)."""
    del key
    G = shape[-1] // MXFP4_BLOCK
    return Mxfp4Weight(jnp.zeros(tuple(shape[:-1]) + (G, MXFP4_BLOCK // 2), jnp.uint8),
                       jnp.zeros(tuple(shape[:-1]) + (G,), jnp.uint8), jnp.dtype(dtype).name)


def dummy(key, shape, dtype, scale: float = 0.02) -> Mxfp4Weight:
    """Random packed weights of a [..., rows, cols] weight with values of standard deviation
    about ``scale`` (load_format="dummy"): uniform codes (standard deviation 2.9 over the 16
    values) under one power of two."""
    G = shape[-1] // MXFP4_BLOCK
    blocks = jax.random.bits(key, tuple(shape[:-1]) + (G, MXFP4_BLOCK // 2), jnp.uint8)  # no wider temporary
    exp = 127 + int(np.round(np.log2(scale / float(np.std(FP4_VALUES)))))
    return Mxfp4Weight(blocks, jnp.full(tuple(shape[:-1]) + (G,), exp, jnp.uint8), jnp.dtype(dtype).name)
