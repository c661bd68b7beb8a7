"""FP8 weights (weight-only): config.json's ``quantization_config`` translated, the weight
pytree the ops dequantize, and the quantizer of unquantized weights.

Two checkpoint formats (what vLLM reads as ``quantization="compressed-tensors"`` and
``"fp8"``), both float8_e4m3fn weights ``[out, in]`` with float scales, dequantized as
``w * scale``:
  - compressed-tensors (llm-compressor): ``<module>.weight_scale`` per output channel
    ``[out, 1]``, per tensor ``[1]``, or per block ``[ceil(out/b0), ceil(in/b1)]``; with
    static activations also ``<module>.input_scale``, which a weight-only path never reads;
  - "fp8" (DeepSeek, Qwen3-*-FP8): ``<module>.weight_scale_inv`` per block
    ``[ceil(out/b0), ceil(in/b1)]`` (``weight_block_size``), or ``<module>.weight_scale`` per
    tensor without a block size.
``quantization="fp8"`` on an unquantized checkpoint (vLLM's online FP8) quantizes every
projection per output channel as it loads (``quantize_fp8``). Which modules are quantized:
the decoder layers' projections (q/k/v/o, gate/up/down, each expert's), unless the config
leaves them out; the embedding, the lm_head and a mixture-of-experts router never are (as
vLLM's models build them).

A quantized leaf of the parameter tree is a ``QuantWeight`` (f8 weight + f32 scale, in the
weight's layout); jspec/ops.py dequantizes it right before the dot through XLA. Activations:
where the checkpoint asks for FP8 activations (``QuantConfig.activations``) and the GPU has FP8
tensor cores, the XLA GEMMs of more rows than the projection kernels take quantize them
per token, dynamically (``KernelPlan.fp8_gemm``, vLLM's W8A8; JSPEC_FP8_GEMM=0 turns it off;
static ``input_scale`` tensors stay unread); everything else is weight-only.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from flax import struct

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8 = jnp.float8_e4m3fn
METHODS = ("fp8", "compressed-tensors")  # vLLM's names, EngineConfig.quantization's values


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How a checkpoint's projection weights are quantized (hashable: part of ModelConfig)."""

    method: str  # "compressed-tensors" | "fp8" (vLLM's name of the format, or of online quantization)
    # The scales as the checkpoint holds them: "channel" [out, 1], "tensor" [1] (or a scalar),
    # "block" [ceil(out / b0), ceil(in / b1)]; "online": none, made at load per output channel.
    scheme: str
    block: tuple[int, int] | None = None  # (b0 rows, b1 columns) of a "block" scale
    scale_suffix: str = "weight_scale"  # "weight_scale_inv" for the "fp8" format's block scales
    ignore: tuple[str, ...] = ()  # modules left unquantized: exact names, or "re:" regular expressions
    substring_ignore: bool = False  # the "fp8" format's modules_to_not_convert: any name containing one
    input_scale: bool = False  # static activation scales in the checkpoint (<module>.input_scale): not read
    # kv_cache_scheme: the checkpoint holds per-tensor FP8 KV-cache scales (<attn>.k_scale, .v_scale),
    # used under kv_cache_dtype="fp8" (jspec/checkpoint/kv_scales.py), ignored by a bf16 cache
    kv_scales: bool = False
    # The checkpoint's projections take FP8 activations (compressed-tensors input_activations, the
    # "fp8" format, online quantization: vLLM's W8A8). Where the device has FP8 tensor cores the GEMMs
    # of many rows then run W8A8 with dynamic per-token activation scales (KernelPlan.fp8_gemm); a
    # weight-only checkpoint (no input_activations: vLLM's W8A16) never quantizes its activations.
    activations: bool = False

    def quantized(self, module: str) -> bool:
        """Whether the projection ``module`` (an HF name, "model.layers.0.self_attn.q_proj") is quantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return False
            elif module == entry or (self.substring_ignore and entry in module):
                return False
        return True


def _err(msg: str):
    from jspec.config import ConfigError  # config.py imports this module

    return ConfigError(f"config.json: quantization_config.{msg}")


# compressed-tensors keys that describe the file, not the maths
_CT_METADATA = {"global_compression_ratio", "quantization_status", "version", "sparsity_config", "transform_config"}
_CT_KEYS = {"quant_method", "format", "config_groups", "ignore", "kv_cache_scheme"} | _CT_METADATA
_FP8_KEYS = {"quant_method", "activation_scheme", "fmt", "weight_block_size", "modules_to_not_convert",
             "ignored_layers"}


def quant_config_from_hf(q) -> QuantConfig | None:
    """config.json's ``quantization_config`` (None when absent) -> QuantConfig; anything jspec
    cannot serve is a ConfigError naming the key and its value."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise _err(f"must be an object, got {q!r}")
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fp8":
        return _fp8(q)
    raise _err(f"quant_method={method!r} is not supported (supported: {list(METHODS)}, FP8 weights)")


def _unknown(q: dict, known: set, method: str):
    if unknown := sorted(k for k in q if k not in known):
        raise _err(f"{unknown[0]}={q[unknown[0]]!r} is not supported for quant_method {method!r}")


def _compressed_tensors(q: dict) -> QuantConfig:
    _unknown(q, _CT_KEYS, "compressed-tensors")
    if q.get("format") not in ("float-quantized", "naive-quantized"):
        raise _err(f"format={q.get('format')!r} is not supported (supported: 'float-quantized', 'naive-quantized')")
    kv_scales = _kv_cache_scheme(q.get("kv_cache_scheme"))
    if q.get("sparsity_config"):
        raise _err(f"sparsity_config={q['sparsity_config']!r} is not supported")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _err(f"config_groups={groups!r}: one or more groups expected")
    schemes = {_ct_group(f"config_groups.{name}", g) for name, g in groups.items()}
    if len(schemes) > 1:
        raise _err(f"config_groups: groups with different weight schemes {sorted(map(str, schemes))} are not "
                   f"supported")
    (scheme, block, static, acts), = schemes
    ignore = q.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise _err(f"ignore={ignore!r}: a list of module names expected")
    return QuantConfig("compressed-tensors", scheme, block, "weight_scale", tuple(ignore), False, static, kv_scales,
                       acts)


def _kv_cache_scheme(kv) -> bool:
    """compressed-tensors' kv_cache_scheme: None, or static per-tensor FP8 e4m3 scales (what
    llm-compressor writes and vLLM reads: one k_scale and one v_scale per layer) -> True; any
    other scheme is an error naming its key."""
    if kv is None:
        return False
    if not isinstance(kv, dict):
        raise _err(f"kv_cache_scheme={kv!r}: an object expected")
    for key, want in (("num_bits", 8), ("type", "float"), ("strategy", "tensor"), ("dynamic", False),
                      ("symmetric", True)):
        if kv.get(key, want) != want:
            raise _err(f"kv_cache_scheme.{key}={kv.get(key)!r} is not supported (only {want!r}: static per-tensor "
                       f"FP8 e4m3 KV-cache scales)")
    return True


def _ct_group(where: str, g) -> tuple[str, tuple[int, int] | None, bool, bool]:
    """A config group's (scheme, block, static input scales, FP8 activations); errors name the key."""
    if not isinstance(g, dict):
        raise _err(f"{where}={g!r}: an object expected")
    if g.get("targets") != ["Linear"]:
        raise _err(f"{where}.targets={g.get('targets')!r} is not supported (only ['Linear'])")
    if g.get("output_activations") is not None:
        raise _err(f"{where}.output_activations={g['output_activations']!r} is not supported")
    w = g.get("weights")
    if not isinstance(w, dict):
        raise _err(f"{where}.weights={w!r}: an object expected")
    for key, want in (("num_bits", 8), ("type", "float"), ("symmetric", True)):
        if w.get(key, want) != want:
            raise _err(f"{where}.weights.{key}={w.get(key)!r} is not supported (only {want!r}: FP8 e4m3 weights)")
    for key in ("dynamic", "group_size", "actorder"):
        if w.get(key) not in (None, False):
            raise _err(f"{where}.weights.{key}={w[key]!r} is not supported")
    strategy, block = w.get("strategy"), None
    if strategy == "block":
        block = _block(w.get("block_structure"), f"{where}.weights.block_structure")
    elif strategy not in ("channel", "tensor"):
        raise _err(f"{where}.weights.strategy={strategy!r} is not supported (supported: 'channel', 'tensor', "
                   f"'block')")
    a = g.get("input_activations")
    if a is not None:
        if not isinstance(a, dict) or a.get("num_bits") != 8 or a.get("type") != "float":
            raise _err(f"{where}.input_activations={a!r} is not supported (FP8 activations, or none)")
    return strategy, block, bool(a is not None and not a.get("dynamic")), a is not None


def _block(b, where: str) -> tuple[int, int]:
    if not (isinstance(b, (list, tuple)) and len(b) == 2 and all(isinstance(x, int) and x > 0 for x in b)):
        raise _err(f"{where}={b!r}: [rows, columns] of positive integers expected")
    return int(b[0]), int(b[1])


def _fp8(q: dict) -> QuantConfig:
    _unknown(q, _FP8_KEYS, "fp8")
    if q.get("fmt", "e4m3") != "e4m3":
        raise _err(f"fmt={q['fmt']!r} is not supported (only 'e4m3')")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _err(f"activation_scheme={scheme!r} is not supported (supported: 'dynamic', 'static')")
    skip = q.get("modules_to_not_convert") or q.get("ignored_layers") or []
    if not isinstance(skip, list) or not all(isinstance(i, str) for i in skip):
        raise _err(f"modules_to_not_convert={skip!r}: a list of module names expected")
    if q.get("weight_block_size") is None:  # one scale per tensor
        return QuantConfig("fp8", "tensor", None, "weight_scale", tuple(skip), True, scheme == "static",
                           activations=True)
    block = _block(q["weight_block_size"], "weight_block_size")
    return QuantConfig("fp8", "block", block, "weight_scale_inv", tuple(skip), True, scheme == "static",
                       activations=True)


ONLINE = QuantConfig("fp8", "online", activations=True)


def resolve(checkpoint: QuantConfig | None, requested: str | None, folder: str) -> QuantConfig | None:
    """The quantization a target loads with: its checkpoint's (config.json), which a request
    must match, as vLLM; or ``requested="fp8"`` on an unquantized checkpoint: ONLINE."""
    if requested is not None and requested not in METHODS:
        raise ValueError(f"quantization={requested!r} is not supported (supported: {list(METHODS)} or None)")
    if checkpoint is not None:
        if requested not in (None, checkpoint.method):
            raise ValueError(f"quantization={requested!r} does not match the checkpoint {folder!r}, whose "
                             f"config.json quantization_config has quant_method {checkpoint.method!r}")
        return checkpoint
    if requested == "compressed-tensors":
        raise ValueError(f"quantization='compressed-tensors' needs a compressed-tensors checkpoint: {folder!r} has "
                         f"no quantization_config (quantization='fp8' quantizes unquantized weights at load)")
    return ONLINE if requested == "fp8" else None


# ---- the weights -------------------------------------------------------------------------
@struct.dataclass
class QuantWeight:
    """A quantized projection weight: ``w * scale``, the scale broadcast per output channel or
    expanded per block. In the weight's own layout: HF's [out, in] (``[in, out]`` under the CPU
    plan, ops.weight_shape; a mixture-of-experts leaf [E, out, in]); a per-channel scale is then
    [..., out, 1] ([1, out]), a block scale [..., ceil(rows / block[0]), ceil(cols / block[1])]
    over the weight's last two axes. The first leaf is ``w``: Flax checks its shape against the
    module's declared weight shape."""

    w: jax.Array  # f8e4m3[..., rows, cols]
    scale: jax.Array  # f32[..., rows, 1] | f32[..., 1, cols] (per channel) | f32[..., R, C] (per block)
    block: tuple[int, int] | None = struct.field(pytree_node=False, default=None)  # over (rows, cols)
    dtype: str = struct.field(pytree_node=False, default="float32")  # the compute dtype it dequantizes to

    @property
    def shape(self):
        return self.w.shape

    @property
    def ndim(self):
        return self.w.ndim

    @property
    def T(self) -> QuantWeight:  # noqa: N802  (numpy's name: the 2-D weight transposed, its scale with it)
        b = None if self.block is None else self.block[::-1]
        return QuantWeight(self.w.T, self.scale.T, b, self.dtype)

    def dequantize(self) -> jax.Array:
        """[..., rows, cols] in ``dtype``: w * scale in float32, rounded once (XLA fuses the
        conversion into the consumer where it can)."""
        s = self.scale if self.block is None else _per_element(self.scale, self.block, self.w.shape)
        return (self.w.astype(jnp.float32) * s).astype(self.dtype)

    def take(self, idx) -> QuantWeight:
        """The stacked experts ``idx`` (axis 0) of a [E, ...] leaf, still quantized."""
        return QuantWeight(jnp.take(self.w, idx, axis=0), jnp.take(self.scale, idx, axis=0), self.block, self.dtype)


def _per_element(scale, block: tuple[int, int], shape):
    """A block scale [..., R, C] repeated over its blocks' elements: [..., rows, cols] of ``shape``
    (the last blocks cut to the weight's edge)."""
    (b0, b1), (r, c) = block, shape[-2:]
    return jnp.repeat(jnp.repeat(scale, b0, axis=-2)[..., :r, :], b1, axis=-1)[..., :c]


def quantize_fp8(w, block: tuple[int, int] | None = None, dtype="float32") -> QuantWeight:
    """An [..., out, in] weight (HF layout) as FP8: per output channel (``block`` None), or per
    block, the scale amax / 448 (1 where all zeros), the values rounded to nearest."""
    w = jnp.asarray(w).astype(jnp.float32)
    if block is None:
        amax = jnp.max(jnp.abs(w), axis=-1, keepdims=True)
        scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
        full = scale
    else:
        (b0, b1), (r, c) = block, w.shape[-2:]
        R, C = -(-r // b0), -(-c // b1)
        pad = [(0, 0)] * (w.ndim - 2) + [(0, R * b0 - r), (0, C * b1 - c)]
        tiles = jnp.pad(jnp.abs(w), pad).reshape(w.shape[:-2] + (R, b0, C, b1))
        amax = jnp.max(tiles, axis=(-3, -1))
        scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
        full = _per_element(scale, block, w.shape)
    q = jnp.clip(w / full, -FP8_MAX, FP8_MAX).astype(FP8)
    return QuantWeight(q, scale.astype(jnp.float32), block, jnp.dtype(dtype).name)

