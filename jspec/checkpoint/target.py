"""Target-model parameters from a HF checkpoint folder or an orbax copy of one.

``target_param_spec`` is the single map from our parameter tree to HF tensor names; the
loader, the orbax restore and the error messages all come from it (the spec type and the
check / load loop, shared with the drafters, are in param_spec.py).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from jspec.checkpoint import kv_scales
from jspec.checkpoint.dummy import check_load_format, dummy_params
from jspec.checkpoint.param_spec import (
    DTYPES,
    ParamSpec,
    SpecList,
    check_specs,
    load_params,
    resolve_dtype,
    set_path,
)
from jspec.checkpoint.quantized import dummy_quant, quant_spec
from jspec.checkpoint.safetensors_io import CheckpointError
from jspec.checkpoint.tensor_sources import open_tensor_source
from jspec.config import ModelConfig, load_model_config
from jspec.parallel.placement import Placement
from jspec.quantization import resolve as resolve_quantization

# DTYPES, ParamSpec, resolve_dtype and set_path are re-exported for existing importers.
__all__ = [
    "DTYPES", "ORBAX_DIR", "ParamSpec", "flat_params", "load_target", "resolve_dtype", "restore_orbax",
    "save_orbax", "set_path", "target_param_spec",
]

ORBAX_DIR = "orbax_params"


def target_param_spec(c: ModelConfig) -> list[ParamSpec]:
    """Our tree <- HF names, with the Megatron split of each leaf (ParamSpec.split): q/k/v and
    gate/up by output rows, o and down by input columns, embedding and lm_head by vocabulary
    (padded where tp does not divide it: ParamSpec.vocab); norms and the o / down biases
    replicated. Under c.quantization the decoder layers' projection weights are FP8 with
    their scales (ParamSpec.quant, jspec/checkpoint/quantized.py)."""
    H, D, I = c.hidden_size, c.head_dim, c.intermediate_size
    specs = SpecList()

    def quant(modules, shapes, stacked=1):  # the scales of a leaf of these projections
        return quant_spec(c.quantization, modules, shapes, stacked)

    specs.add(("embed_tokens", "embedding"), ["model.embed_tokens.weight"], [(c.vocab_size, H)], vocab=True)
    for i in range(c.num_layers):
        p, L = f"model.layers.{i}", f"layers_{i}"
        specs.add((L, "input_layernorm", "weight"), [f"{p}.input_layernorm.weight"], [(H,)])
        specs.add((L, "post_attention_layernorm", "weight"), [f"{p}.post_attention_layernorm.weight"], [(H,)])
        qkv = [f"{p}.self_attn.{n}_proj" for n in "qkv"]
        qkv_shapes = [(c.q_size,), (c.kv_size,), (c.kv_size,)]
        specs.add((L, "attn", "qkv_proj", "weight"), [n + ".weight" for n in qkv], [s + (H,) for s in qkv_shapes],
                  split=0, quant=quant(qkv, [s + (H,) for s in qkv_shapes]))
        if c.attention_bias:
            specs.add((L, "attn", "qkv_proj", "bias"), [n + ".bias" for n in qkv], qkv_shapes, split=0)
            specs.add((L, "attn", "o_proj", "bias"), [f"{p}.self_attn.o_proj.bias"], [(H,)])
        specs.add((L, "attn", "o_proj", "weight"), [f"{p}.self_attn.o_proj.weight"], [(H, c.q_size)], split=1,
                  quant=quant([f"{p}.self_attn.o_proj"], [(H, c.q_size)]))
        if c.qk_norm:
            specs.add((L, "attn", "q_norm", "weight"), [f"{p}.self_attn.q_norm.weight"], [(D,)])
            specs.add((L, "attn", "k_norm", "weight"), [f"{p}.self_attn.k_norm.weight"], [(D,)])
        if c.attention_sinks:
            specs.add((L, "attn", "sinks"), [f"{p}.self_attn.sinks"], [(c.num_heads,)])
        if c.family == "gpt_oss":
            _gpt_oss_experts(specs, c, p, L)
            continue
        if c.is_moe(i):  # the router and every expert's gate|up and down, stacked [E, ...]
            E, Im = c.num_experts, c.moe_intermediate_size
            ex = [f"{p}.mlp.experts.{e}" for e in range(E)]
            specs.add((L, "mlp", "gate", "weight"), [f"{p}.mlp.gate.weight"], [(E, H)])
            gate_up = [f"{x}.{n}_proj" for x in ex for n in ("gate", "up")]
            specs.add((L, "mlp", "gate_up"), [n + ".weight" for n in gate_up], [(Im, H)] * 2 * E, shape=(E, 2 * Im, H),
                      quant=quant(gate_up, [(Im, H)] * 2 * E, E))
            specs.add((L, "mlp", "down"), [f"{x}.down_proj.weight" for x in ex], [(H, Im)] * E, shape=(E, H, Im),
                      quant=quant([f"{x}.down_proj" for x in ex], [(H, Im)] * E, E))
            continue
        gu = [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"]
        specs.add((L, "mlp", "gate_up_proj", "weight"), [n + ".weight" for n in gu], [(I, H), (I, H)], split=0,
                  quant=quant(gu, [(I, H), (I, H)]))
        specs.add((L, "mlp", "down_proj", "weight"), [f"{p}.mlp.down_proj.weight"], [(H, I)], split=1,
                  quant=quant([f"{p}.mlp.down_proj"], [(H, I)]))
        if c.mlp_bias:
            specs.add((L, "mlp", "gate_up_proj", "bias"), [n + ".bias" for n in gu], [(I,), (I,)], split=0)
            specs.add((L, "mlp", "down_proj", "bias"), [f"{p}.mlp.down_proj.bias"], [(H,)])
    specs.add(("norm", "weight"), ["model.norm.weight"], [(H,)])
    if not c.tie_word_embeddings:
        specs.add(("lm_head",), ["lm_head.weight"], [(c.vocab_size, H)], vocab=True)
    return specs


def _gpt_oss_experts(specs: SpecList, c: ModelConfig, p: str, L: str):
    """gpt-oss's router and experts (jspec/checkpoint/gpt_oss_layout.py: its interleaved,
    transposed bf16 tensors or its MXFP4 blocks and scales, each into our layout)."""
    E, H, Im = c.num_experts, c.hidden_size, c.moe_intermediate_size
    x = f"{p}.mlp.experts"
    specs.add((L, "mlp", "gate", "weight"), [f"{p}.mlp.router.weight"], [(E, H)])
    specs.add((L, "mlp", "gate", "bias"), [f"{p}.mlp.router.bias"], [(E,)])
    if c.mxfp4:
        for name, rows, cols, ours in (("gate_up", 2 * Im, H, (E, 2 * Im, H)), ("down", H, Im, (E, H, Im))):
            if cols % 32:
                raise CheckpointError(f"{x}.{name}_proj: MXFP4 needs a multiple of 32 columns, config.json gives {cols}")
            specs.add((L, "mlp", name), [f"{x}.{name}_proj_blocks", f"{x}.{name}_proj_scales"],
                      [(E, rows, cols // 32, 16), (E, rows, cols // 32)], shape=ours, layout=f"mxfp4_{name}")
    else:
        specs.add((L, "mlp", "gate_up"), [f"{x}.gate_up_proj"], [(E, H, 2 * Im)], shape=(E, 2 * Im, H),
                  layout="gpt_oss_gate_up")
        specs.add((L, "mlp", "down"), [f"{x}.down_proj"], [(E, Im, H)], shape=(E, H, Im), layout="gpt_oss_down")
    specs.add((L, "mlp", "gate_up_bias"), [f"{x}.gate_up_proj_bias"], [(E, 2 * Im)], layout="gpt_oss_gate_up_bias")
    specs.add((L, "mlp", "down_bias"), [f"{x}.down_proj_bias"], [(E, H)])


def save_orbax(params, folder: str) -> str:
    """Write ``params`` as an orbax checkpoint under ``folder/orbax_params``."""
    import orbax.checkpoint as ocp

    out = os.path.abspath(os.path.join(folder, ORBAX_DIR))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out, params, force=True)
    return out


def restore_orbax(folder, specs, dtype, sharding=None):
    """The tree of ``specs`` from ``folder/orbax_params``. With a Placement (tensor
    parallelism) every leaf is restored sharded (orbax reads each device's part) and the
    fused leaves are then put in the tp-interleaved layout on the devices; a vocabulary tp
    does not divide is restored whole, then padded and split (Placement.from_concatenated)."""
    import orbax.checkpoint as ocp

    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    place = sharding if isinstance(sharding, Placement) else None
    target: dict = {}
    for spec in specs:
        s = place.restore_sharding(spec) if place else sharding
        set_path(target, spec.path, jax.ShapeDtypeStruct(spec.shape, dtype, sharding=s))
    path = os.path.abspath(os.path.join(folder, ORBAX_DIR))
    with ocp.StandardCheckpointer() as ckptr:
        try:
            params = ckptr.restore(path, target)
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"orbax checkpoint {path!r} does not match config.json: {e}") from None
    if place is not None:
        for spec in specs:
            leaf = params
            for k in spec.path:
                leaf = leaf[k]
            set_path(params, spec.path, place.from_concatenated(leaf, spec))
    return params


def auto_dtype(checkpoint_dtype: str, backend: str) -> str:
    """What ``dtype="auto"`` loads: the checkpoint's dtype (config.json), as vLLM, except on a
    CPU, where XLA emulates 16-bit floats (the family decoded at 4.9 tok/s in bfloat16 and
    228 in float32 on two cores): float32 there."""
    return "float32" if backend == "cpu" else checkpoint_dtype


def load_target(path, dtype="float32", sharding=None, progress=None, load_format="auto", quantization=None,
                kv_cache_scales: bool = False):
    """Load (ModelConfig, params) from a HF folder, or from its orbax copy when present.

    A folder holding ``orbax_params/`` (written by scripts/convert_to_orbax.py) restores
    from orbax; otherwise its safetensors (or pytorch_model.bin) are streamed.
    ``load_format="dummy"`` reads config.json alone and draws random weights
    (jspec/checkpoint/dummy.py). ``sharding``: a jax Sharding for every leaf, or a
    ``jspec.parallel.Placement`` (tensor parallelism, each leaf split by its ParamSpec).
    ``quantization`` (vLLM's argument): None or the method of the checkpoint's
    quantization_config (FP8 weights, read as they are), or "fp8" on an unquantized checkpoint:
    its projections quantized per output channel as they load (jspec/quantization.py).
    ``kv_cache_scales`` (an FP8 KV cache): the checkpoint's KV-cache scales, where its
    quantization_config declares them, folded into the attention's weights
    (jspec/checkpoint/kv_scales.py); otherwise they are not read.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is not a directory")
    cfg = load_model_config(path)
    cfg = dataclasses.replace(cfg, quantization=resolve_quantization(cfg.quantization, quantization, path))
    if isinstance(sharding, Placement):  # tensor parallelism: the shapes must split (before any read)
        sharding.check_target(cfg)
    dt = resolve_dtype(dtype)
    specs = target_param_spec(cfg)
    if isinstance(sharding, Placement):
        sharding.check_quant(specs)
    if check_load_format(load_format) == "dummy":
        params = dummy_params(specs, dt, seed=0, sharding=sharding)
    elif os.path.isdir(os.path.join(path, ORBAX_DIR)):
        if cfg.quantization is not None or cfg.mxfp4:
            raise CheckpointError(f"{path!r}: an orbax copy of quantized weights is not supported (remove "
                                  f"{ORBAX_DIR}/ to read the safetensors)")
        params = restore_orbax(path, specs, dt, sharding)
    else:
        with open_tensor_source(path) as src:
            # Every name and shape up front, so a bad checkpoint fails before any transfer.
            has_kv_scales = bool(cfg.quantization and cfg.quantization.kv_scales)
            kv_names = kv_scales.tensor_names(src, cfg) if has_kv_scales else []
            check_specs(src, specs, path, "checkpoint", ignored=kv_names)
            if kv_cache_scales and has_kv_scales:
                src = kv_scales.Scaled(src, kv_scales.factors(cfg, kv_scales.read(src, cfg, path)))
            params = load_params(src, specs, dt, sharding, progress)
    jax.block_until_ready(params)
    return cfg, params


def quantize_target(cfg: ModelConfig, params: dict, quantization: str | None, dtype) -> tuple[ModelConfig, dict]:
    """A target's unquantized parameter tree (HF layout; benchmarks' random weights made on
    the device) under ``quantization`` as load_target would hold it: "fp8" quantizes its
    projections per output channel, None leaves it as it is."""
    qc = resolve_quantization(cfg.quantization, quantization, "the preloaded weights")
    if qc is None or cfg.quantization is not None:  # unquantized, or the tree's own (already FP8)
        return cfg, params
    cfg = dataclasses.replace(cfg, quantization=qc)
    out = jax.tree.map(lambda x: x, params)  # a copy of the containers: the caller's tree is left alone
    for spec in target_param_spec(cfg):
        if spec.quant is not None:
            leaf = out
            for k in spec.path:
                leaf = leaf[k]
            set_path(out, spec.path, dummy_quant(leaf, spec, resolve_dtype(dtype)))
    return cfg, out


def flat_params(params) -> dict[str, np.ndarray]:
    """{'a/b/c': array} view of a param tree (tests, tools)."""
    out = {}
    for kp, v in jax.tree_util.tree_leaves_with_path(params):
        out["/".join(str(getattr(k, "key", k)) for k in kp)] = v
    return out
