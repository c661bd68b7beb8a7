"""Random MXFP4 weights as checkpoints pack them (the kernel tests' and the GPU check's)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def packed(rng: np.random.Generator, *shape: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """A weight [..., out, in] -> (blocks u8[..., out, in / 32, 16], scales u8[..., out, in / 32]):
    random codes, block scales 2^-7 .. 2^-2 (120-125), so that products stay in bf16's range."""
    blocks = rng.integers(0, 256, shape[:-1] + (shape[-1] // 32, 16), dtype=np.uint8)
    scales = rng.integers(120, 126, shape[:-1] + (shape[-1] // 32,), dtype=np.uint8)
    return jnp.asarray(blocks), jnp.asarray(scales)
