"""Drafter parameters from a checkpoint folder (speculators, original EAGLE3, z-lab DFlash).

``drafter_param_spec`` is the single map from our parameter tree to the checkpoint's tensor
names for every layout; the load goes through the targets' spec and loader
(jspec/checkpoint/param_spec.py), so names and shapes are all checked before any tensor is
read and a bad checkpoint fails with the tensor's name (and both shapes) rather than deep in
a forward.
"""

from __future__ import annotations

import os

from jspec.checkpoint.dummy import check_load_format, dummy_params
from jspec.checkpoint.param_spec import ParamSpec, SpecList, check_specs, load_params, resolve_dtype
from jspec.checkpoint.tensor_sources import open_tensor_source
from jspec.config import ConfigError, ModelConfig, read_json_object
from jspec.drafters.config import FMT_EAGLE3_ORIGINAL, DrafterConfig, detect_format, drafter_config_from_hf
from jspec.parallel.placement import Placement


def drafter_param_spec(c: DrafterConfig) -> list[ParamSpec]:
    """Our tree <- the layout's names; the Megatron splits (ParamSpec.split) as the target's
    (the vocabulary tables padded: ParamSpec.vocab), fc by its input columns (the aux
    states), norms, d2t and mask_hidden replicated. The fc, final norm and d2t every layout
    has, then the method's own tensors (``Method.param_spec``), in this load order."""
    from jspec.drafters.registry import method_of  # the methods' modules import this one

    method = method_of(c.method)
    if method.param_spec is None:
        raise ValueError(f"the {method.label} method has no drafter checkpoint tensors (Method.param_spec)")
    specs = SpecList()
    specs.add(("fc", "weight"), ["fc.weight"], [(c.hidden_size, c.fc_in_features)], split=1)
    specs.add(("norm", "weight"), ["norm.weight"], [(c.hidden_size,)])
    if c.has_d2t:
        specs.add(("d2t",), ["d2t"], [(c.draft_vocab_size,)], integer=True)
    method.param_spec(c, specs)
    return specs


def add_layer_specs(specs: SpecList, c: DrafterConfig, i: int, prefix: str, in_features: int, *, fused_qkv: bool):
    """Decoder layer ``layers_{i}`` of our tree <- the checkpoint's ``{prefix}.*`` tensors:
    norms, attention (q/k/v fused into one leaf, or q apart from a fused k/v: DFlash, whose
    context projects only k/v), its biases and q/k norms where the config has them, the MLP.
    ``in_features``: the attention's input width (EAGLE3's first layer reads 2 H)."""
    H, D, I = c.hidden_size, c.head_dim, c.intermediate_size
    L = f"layers_{i}"
    specs.add((L, "input_layernorm", "weight"), [f"{prefix}.input_layernorm.weight"], [(H,)])
    specs.add((L, "post_attention_layernorm", "weight"), [f"{prefix}.post_attention_layernorm.weight"], [(H,)])
    a = f"{prefix}.self_attn"
    if fused_qkv:
        qkv = [f"{a}.{n}_proj" for n in "qkv"]
        shapes = [(c.q_size,), (c.kv_size,), (c.kv_size,)]
        specs.add((L, "attn", "qkv_proj", "weight"), [n + ".weight" for n in qkv], [s + (in_features,) for s in shapes],
                  split=0)
        if c.attention_bias:
            specs.add((L, "attn", "qkv_proj", "bias"), [n + ".bias" for n in qkv], shapes, split=0)
    else:
        specs.add((L, "attn", "q_proj", "weight"), [f"{a}.q_proj.weight"], [(c.q_size, in_features)], split=0)
        specs.add((L, "attn", "kv_proj", "weight"), [f"{a}.k_proj.weight", f"{a}.v_proj.weight"],
                  [(c.kv_size, in_features), (c.kv_size, in_features)], split=0)
        if c.attention_bias:
            specs.add((L, "attn", "q_proj", "bias"), [f"{a}.q_proj.bias"], [(c.q_size,)], split=0)
            specs.add((L, "attn", "kv_proj", "bias"), [f"{a}.k_proj.bias", f"{a}.v_proj.bias"], [(c.kv_size,), (c.kv_size,)],
                      split=0)
    specs.add((L, "attn", "o_proj", "weight"), [f"{a}.o_proj.weight"], [(H, c.q_size)], split=1)
    if c.attention_bias:
        specs.add((L, "attn", "o_proj", "bias"), [f"{a}.o_proj.bias"], [(H,)])
    if c.qk_norm:
        specs.add((L, "attn", "q_norm", "weight"), [f"{a}.q_norm.weight"], [(D,)])
        specs.add((L, "attn", "k_norm", "weight"), [f"{a}.k_norm.weight"], [(D,)])
    m = f"{prefix}.mlp"
    specs.add((L, "mlp", "gate_up_proj", "weight"), [f"{m}.gate_proj.weight", f"{m}.up_proj.weight"],
              [(I, H), (I, H)], split=0)
    specs.add((L, "mlp", "down_proj", "weight"), [f"{m}.down_proj.weight"], [(H, I)], split=1)
    if c.mlp_bias:
        specs.add((L, "mlp", "gate_up_proj", "bias"), [f"{m}.gate_proj.bias", f"{m}.up_proj.bias"], [(I,), (I,)],
                  split=0)
        specs.add((L, "mlp", "down_proj", "bias"), [f"{m}.down_proj.bias"], [(H,)])


def infer_method(path) -> str:
    """vLLM's speculative method for a checkpoint given without one: a drafter layout's
    (detect_format), else "draft_model" (an ordinary LLM, checked when it loads)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"speculative_config 'model' {path!r} is not a directory")
    d = read_drafter_config(path)
    try:
        return detect_format(d)[0]
    except ConfigError:
        if "speculators_model_type" in d or any("Draft" in a or "Eagle" in a for a in d.get("architectures") or []):
            raise  # a drafter layout jspec does not read: its own error
        return "draft_model"


def read_drafter_config(path) -> dict:
    cfg_path = os.path.join(os.fspath(path), "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"no config.json at {cfg_path}")
    return read_json_object(cfg_path)


# The tensors a config.json alone cannot tell about, as load_format="dummy" assumes them:
# the optional tensors a layout requires (d2t, mask_hidden) exist, and EAGLE3 / PEagle heads
# in the speculators format carry their own embeddings (speculators writes them); original
# EAGLE3 heads share the target's (DFlash always does: its translation never reads the name).
def _dummy_tensor_names(method: str, fmt: str) -> frozenset[str]:
    del method  # the layout tells
    own = {"embed_tokens.weight"} if fmt != FMT_EAGLE3_ORIGINAL else set()
    return frozenset({"d2t", "mask_hidden"} | own)


def _config_for(path: str, d: dict, target_cfg: ModelConfig, tensor_names) -> DrafterConfig:
    """drafter_config_from_hf, its errors naming the drafter's folder."""
    try:
        return drafter_config_from_hf(d, target_cfg, tensor_names)
    except ValueError as e:
        raise type(e)(f"drafter {path!r}: {e}") from None


def load_from_spec(spec, target_cfg: ModelConfig, dtype, sharding, load_format):
    """``Method.load`` of a drafter checkpoint layout: load_drafter of ``spec.model``."""
    return load_drafter(spec.model, target_cfg, dtype, sharding, load_format=load_format)


def load_drafter(path, target_cfg: ModelConfig, dtype="float32", sharding=None, load_format="auto"):
    """(DrafterConfig, params) for the drafter at ``path`` serving a target of ``target_cfg``.

    ``load_format="dummy"``: config.json alone, random weights (jspec/checkpoint/dummy.py).
    Raises ConfigError (unsupported config), ValueError (drafter/target mismatch) or
    CheckpointError (missing tensor, wrong shape), each naming what is wrong.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"drafter path {path!r} is not a directory")
    d = read_drafter_config(path)
    dt = resolve_dtype(dtype)
    if check_load_format(load_format) == "dummy":
        cfg = _config_for(path, d, target_cfg, _dummy_tensor_names(*detect_format(d)))
        if isinstance(sharding, Placement):
            sharding.check_drafter(cfg)
        return cfg, dummy_params(drafter_param_spec(cfg), dt, seed=1, sharding=sharding)
    with open_tensor_source(path) as src:
        cfg = _config_for(path, d, target_cfg, frozenset(src.names()))
        if isinstance(sharding, Placement):  # tensor parallelism: the shapes must split (before any read)
            sharding.check_drafter(cfg)
        specs = drafter_param_spec(cfg)
        check_specs(src, specs, path, "drafter checkpoint")
        return cfg, load_params(src, specs, dt, sharding)
