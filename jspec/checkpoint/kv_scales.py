"""A checkpoint's FP8 KV-cache scales (compressed-tensors ``kv_cache_scheme``), folded into the
attention's weights as they load, so that the kernels write and read the cache as with scales
of 1.0.

A checkpoint calibrated for an FP8 cache holds per layer ``self_attn.k_scale`` and
``self_attn.v_scale`` (float scalars; older files: ``k_proj.output_scale`` /
``v_proj.output_scale``): the cache holds k / k_scale and v / v_scale in e4m3, and attention
reads them back times the scale (vLLM's meaning). Both are linear in the weights that make and
read k and v:
  scores  q . k = (k_scale q) . (k / k_scale): q's weights times k_scale, k's divided by it;
  output  o_proj(sum p v) = (v_scale o_proj)(sum p (v / v_scale)): v's weights divided by
          v_scale, o_proj's times it.
RoPE is linear; an RMSNorm erases its input's scale, so under qk_norm (Qwen3) the q_norm and
k_norm weights take the factors instead of q_proj and k_proj. A quantized projection's weight
scale takes its factor (the FP8 bytes stay as stored: an f32 product, no new rounding of the
weight). Used only under kv_cache_dtype="fp8"; a bf16 cache ignores the scales, as vLLM's.
"""

from __future__ import annotations

import math

import numpy as np

from jspec.checkpoint.safetensors_io import CheckpointError
from jspec.config import ModelConfig

# each layer's scale tensors, by the names checkpoints use (first: llm-compressor's and vLLM's)
_NAMES = {"k": ("self_attn.k_scale", "self_attn.k_proj.output_scale"),
          "v": ("self_attn.v_scale", "self_attn.v_proj.output_scale")}


def tensor_names(src, c: ModelConfig) -> list[str]:
    """The KV-scale tensors ``src`` holds (known tensors, not "unused" ones)."""
    return [n for i in range(c.num_layers) for kind in _NAMES for n in _candidates(i, kind) if n in src]


def _candidates(i: int, kind: str) -> list[str]:
    return [f"model.layers.{i}.{n}" for n in _NAMES[kind]]


def read(src, c: ModelConfig, folder: str) -> list[tuple[float, float]]:
    """Each layer's (k_scale, v_scale); a missing, misshapen, non-finite or non-positive
    scale is a CheckpointError naming the tensor."""
    out = []
    for i in range(c.num_layers):
        pair = []
        for kind in _NAMES:
            names = _candidates(i, kind)
            name = next((n for n in names if n in src), None)
            if name is None:
                raise CheckpointError(f"checkpoint {folder!r} declares kv_cache_scheme (FP8 KV-cache scales) but is "
                                      f"missing tensor {names[0]!r}")
            if tuple(src.shape(name)) not in ((), (1,)):
                raise CheckpointError(f"tensor {name!r} in {folder!r} has shape {list(src.shape(name))}: a KV-cache "
                                      f"scale is one number per layer (shape [] or [1])")
            v = float(np.asarray(src.get(name), np.float32).reshape(()))
            if not (math.isfinite(v) and v > 0):
                raise CheckpointError(f"tensor {name!r} in {folder!r} is {v}: a KV-cache scale must be finite and > 0")
            pair.append(v)
        out.append(tuple(pair))
    return out


def factors(c: ModelConfig, scales: list[tuple[float, float]]) -> dict[str, float]:
    """{HF tensor name: the factor it is read with} (module docstring)."""
    q = c.quantization
    out = {}

    def weight(module: str, f: float):  # a quantized projection: its weight scale
        quantized = q is not None and q.quantized(module)
        out[f"{module}.{q.scale_suffix}" if quantized else f"{module}.weight"] = f

    for i, (ks, vs) in enumerate(scales):
        p = f"model.layers.{i}.self_attn"
        if c.qk_norm:
            out[f"{p}.q_norm.weight"], out[f"{p}.k_norm.weight"] = ks, 1.0 / ks
        else:
            weight(f"{p}.q_proj", ks)
            weight(f"{p}.k_proj", 1.0 / ks)
            if c.attention_bias:
                out[f"{p}.q_proj.bias"], out[f"{p}.k_proj.bias"] = ks, 1.0 / ks
        weight(f"{p}.v_proj", 1.0 / vs)
        if c.attention_bias:
            out[f"{p}.v_proj.bias"] = 1.0 / vs
        weight(f"{p}.o_proj", vs)
    return out


class Scaled:
    """A tensor source whose float reads of ``factors``' tensors come multiplied by their
    factor (in float32); everything else as ``src`` has it."""

    def __init__(self, src, factors: dict[str, float]):
        self.src, self.factors = src, factors

    def __getattr__(self, name):
        return getattr(self.src, name)

    def __contains__(self, name):
        return name in self.src

    def _scaled(self, name, x):
        f = self.factors.get(name)
        return x if f is None else np.asarray(x, np.float32) * np.float32(f)

    def get(self, name):
        return self._scaled(name, self.src.get(name))

    def get_part(self, name, index):
        return self._scaled(name, self.src.get_part(name, index))
