"""Model configuration: the one place where a Hugging Face ``config.json`` is translated.

``ModelConfig`` is frozen and hashable so it can be a static argument of jitted functions.
Every key of the HF config is either understood, known to be irrelevant to inference
(metadata, training knobs), or rejected with an error naming it: a silently ignored key
could change the maths (a new rope type, sliding windows) without anyone noticing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from jspec.quantization import QuantConfig, quant_config_from_hf

# architecture name -> model family. Decoder-only Llama 3.x / Qwen3 shapes (Qwen3's
# mixture-of-experts models, Qwen3-30B-A3B and the like, are the qwen3 family with experts)
# and gpt-oss (experts in every layer, attention sinks, sliding-window layers, YaRN).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3",
    "GptOssForCausalLM": "gpt_oss",
}
# model_type -> family (the family decides the rest, e.g. Qwen3's per-head q/k RMSNorm)
MODEL_TYPE_FAMILY = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3", "gpt_oss": "gpt_oss"}
SUPPORTED_MODEL_TYPES = set(MODEL_TYPE_FAMILY)

# Keys that carry no meaning for inference here (metadata, training-only knobs, tokens
# handled by the tokenizer / engine). Accepted and ignored.
_IGNORED_KEYS = {
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype",
    "dtype", "initializer_range", "use_cache", "attention_dropout", "bos_token_id",
    "pad_token_id", "output_attentions", "output_hidden_states", "return_dict",
    "pretraining_tp", "layer_types", "max_window_layers",
    "sliding_window", "use_sliding_window", "id2label", "label2id", "tokenizer_class",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "tie_encoder_decoder", "problem_type", "finetuning_task", "prefix", "task_specific_params",
    "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "cross_attention_hidden_size",
    "decoder_start_token_id", "sep_token_id", "architectures_version", "hidden_dropout",
    "embd_pdrop", "resid_pdrop", "router_aux_loss_coef", "output_router_logits",
}
# Qwen3 MoE's keys (transformers 5 writes num_experts as num_local_experts)
_MOE_KEYS = {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
             "decoder_sparse_step", "mlp_only_layers"}
# gpt-oss's own keys (its shipped config.json also carries experts_per_token and
# initial_context_length, the same facts as num_experts_per_tok and the rope's
# original_max_position_embeddings)
_GPT_OSS_KEYS = {"num_local_experts", "num_experts_per_tok", "experts_per_token", "swiglu_alpha", "swiglu_limit",
                 "initial_context_length"}
# Keys that we read (below).
_READ_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_bias",
    "mlp_bias", "eos_token_id", "max_position_embeddings", "quantization_config",
} | _MOE_KEYS


class ConfigError(ValueError):
    """A config.json that jspec cannot serve; the message names the key."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3" | "yarn"
    # llama3 and yarn scaling (only meaningful for those rope types)
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn (gpt-oss): the ramp between interpolated and original frequencies, and the factor
    # cos and sin are multiplied by (jspec.models.layers.rope_inv_freq and rope_for)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 8192
    dtype: str = "float32"  # the checkpoint's (config.json dtype / torch_dtype): what dtype="auto" loads
    # Mixture of experts (Qwen3 MoE): in the layers ``moe_layers`` the MLP is a router over
    # num_experts SwiGLU experts of moe_intermediate_size, num_experts_per_tok of them per
    # token, their outputs summed by the softmax router weights of the chosen ones
    # (renormalised to sum 1 when norm_topk_prob). Elsewhere the dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    # FP8 projection weights (jspec/quantization.py): config.json's quantization_config, or
    # quantization="fp8" on an unquantized checkpoint (quantization.resolve); None: unquantized.
    quantization: QuantConfig | None = None
    # gpt-oss. Attention: a learned logit per head (``sinks``) joins every query's softmax
    # (its share of the probability goes nowhere); in the layers ``sliding_layers`` a query at
    # position p sees keys p - sliding_window < j <= p only. Experts: router and expert
    # biases, gate and up interleaved in the checkpoint, the clamped SwiGLU
    # (up.clip(-limit, limit) + 1) * g * sigmoid(alpha * g), g = gate.clip(max=limit), the
    # router's softmax over its top k (= norm_topk_prob). ``mxfp4``: the checkpoint holds the
    # experts as MXFP4 blocks and scales (dequantized as they load).
    attention_sinks: bool = False
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    moe_bias: bool = False
    swiglu_limit: float = 0.0  # 0: SwiGLU as silu(g) * u (Qwen3); > 0: gpt-oss's clamped form
    swiglu_alpha: float = 1.702
    mxfp4: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def default_aux_layers(self) -> tuple[int, int, int]:
        """EAGLE3's default canonical capture indices [2, L//2, L-3]."""
        L = self.num_layers
        return (2, L // 2, L - 3)

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    def window(self, layer: int) -> int:
        """Keys a query of ``layer`` sees, itself included (0: all before it)."""
        return self.sliding_window if layer in self.sliding_layers else 0

    def num_params(self) -> int:
        h, i, L, v = self.hidden_size, self.intermediate_size, self.num_layers, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h
        mlp = 3 * h * i
        moe = self.num_experts * (3 * h * self.moe_intermediate_size + h)  # experts and router rows
        n_moe = len(self.moe_layers)
        return (L * per_layer + (L - n_moe) * mlp + n_moe * moe + v * h * (1 if self.tie_word_embeddings else 2)
                + h)


def _rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    # transformers < 5 writes rope_theta + rope_scaling; transformers 5 writes rope_parameters.
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    if params is not None and scaling is not None and params != scaling:
        # transformers 5 may write both; rope_parameters is the newer, complete form.
        scaling = None
    src = dict(params or scaling or {})
    theta = float(src.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = src.pop("rope_type", src.pop("type", "default"))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    key = "rope_parameters" if params is not None else "rope_scaling"
    if rope_type == "yarn":
        return _yarn_from_hf(src, theta, d, key)
    if rope_type != "llama3":
        raise ConfigError(
            f"config.json: {key}.rope_type={rope_type!r} is not supported (supported: 'default', 'llama3', 'yarn')"
        )
    try:
        return RopeConfig(
            theta=theta,
            rope_type="llama3",
            factor=float(src["factor"]),
            low_freq_factor=float(src["low_freq_factor"]),
            high_freq_factor=float(src["high_freq_factor"]),
            original_max_position_embeddings=int(src["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ConfigError(f"config.json: llama3 rope scaling is missing key {e.args[0]!r}") from None


def _yarn_from_hf(src: dict[str, Any], theta: float, d: dict[str, Any], key: str) -> RopeConfig:
    """YaRN scaling (transformers' _compute_yarn_parameters): the attention factor, when not
    given, is 0.1 ln(factor) + 1, or its ratio for mscale / mscale_all_dim."""
    unknown = sorted(set(src) - {"factor", "beta_fast", "beta_slow", "truncate", "original_max_position_embeddings",
                                 "attention_factor", "mscale", "mscale_all_dim"})
    if unknown:
        raise ConfigError(f"config.json: {key}.{unknown[0]} is not supported for yarn rope scaling")
    orig = src.get("original_max_position_embeddings") or d.get("initial_context_length")
    factor = src.get("factor")
    if orig is None:
        raise ConfigError(f"config.json: {key}.original_max_position_embeddings is required for yarn rope scaling")
    factor = float(factor if factor is not None else int(d.get("max_position_embeddings", orig)) / int(orig))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = src.get("attention_factor")
    if attention is None:
        m, m_all = src.get("mscale"), src.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeConfig(theta=theta, rope_type="yarn", factor=factor, original_max_position_embeddings=int(orig),
                      beta_fast=float(src.get("beta_fast") or 32.0), beta_slow=float(src.get("beta_slow") or 1.0),
                      truncate=bool(src.get("truncate", True)), attention_factor=float(attention))


def model_config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Translate a HF config dict (Llama 3.x or Qwen3) into a ModelConfig (its
    quantization_config through jspec/quantization.py)."""
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    for a in archs:
        if a not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"config.json: architecture {a!r} is not supported "
                f"(supported: {sorted(SUPPORTED_ARCHITECTURES)})"
            )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"config.json: model_type {model_type!r} is not supported "
            f"(supported: {sorted(SUPPORTED_MODEL_TYPES)})"
        )
    read = _READ_KEYS | (_GPT_OSS_KEYS if model_type == "gpt_oss" else set())
    unknown = sorted(k for k in d if k not in read and k not in _IGNORED_KEYS)
    if unknown:
        raise ConfigError(f"config.json: unsupported key(s) {unknown} for model_type {model_type!r}")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: hidden_act={d['hidden_act']!r} is not supported (only 'silu')")
    if d.get("use_sliding_window"):
        raise ConfigError("config.json: use_sliding_window=true is not supported")
    if int(d.get("pretraining_tp", 1)) != 1:
        raise ConfigError("config.json: pretraining_tp != 1 is not supported")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in d:
            raise ConfigError(f"config.json: required key {key!r} is missing")
    heads = int(d["num_attention_heads"])
    kv_heads = int(d.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ConfigError(
            f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    head_dim = d.get("head_dim") or int(d["hidden_size"]) // heads
    if model_type == "gpt_oss":
        moe = _gpt_oss_from_hf(d, int(d["num_hidden_layers"]))
        quant = None  # its experts' MXFP4 (moe["mxfp4"]); nothing else is quantized
    else:
        moe = _moe_from_hf(d, model_type, int(d["num_hidden_layers"]))
        quant = quant_config_from_hf(d.get("quantization_config"))
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return ModelConfig(
        family=MODEL_TYPE_FAMILY[model_type],
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(d),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)),
        mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm=MODEL_TYPE_FAMILY[model_type] == "qwen3",
        eos_token_ids=eos_ids,
        max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
        dtype=_checkpoint_dtype(d),
        quantization=quant,
        **moe,
    )


def _moe_from_hf(d: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields of a qwen3_moe config (none for the others;
    MoE keys in another model_type's config are an error naming them). A layer i has experts
    unless it is in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0 (Qwen3-MoE's rule)."""
    if model_type != "qwen3_moe":
        given = sorted(k for k in _MOE_KEYS if k in d)
        if given:
            raise ConfigError(f"config.json: key(s) {given} are mixture-of-experts keys, not read for model_type "
                              f"{model_type!r} (Qwen3 MoE checkpoints are model_type 'qwen3_moe')")
        return {}
    experts = d.get("num_experts") or d.get("num_local_experts")
    for key, value in (("num_experts", experts), ("num_experts_per_tok", d.get("num_experts_per_tok")),
                       ("moe_intermediate_size", d.get("moe_intermediate_size"))):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"config.json: {key} must be a positive integer for model_type 'qwen3_moe', got {value!r}")
    if d["num_experts_per_tok"] > experts:
        raise ConfigError(f"config.json: num_experts_per_tok={d['num_experts_per_tok']} exceeds num_experts={experts}")
    step = d.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"config.json: decoder_sparse_step must be a positive integer, got {step!r}")
    dense = d.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ConfigError(f"config.json: mlp_only_layers must be a list of layer indices, got {dense!r}")
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=experts, num_experts_per_tok=d["num_experts_per_tok"],
                moe_intermediate_size=d["moe_intermediate_size"], norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                moe_layers=layers)


def _gpt_oss_from_hf(d: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """ModelConfig's gpt-oss fields: experts in every layer (intermediate_size is theirs),
    sinks, the sliding-window layers of ``layer_types``, MXFP4 experts."""
    experts, k = d.get("num_local_experts"), d.get("num_experts_per_tok") or d.get("experts_per_token")
    for key, value in (("num_local_experts", experts), ("num_experts_per_tok", k)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"config.json: {key} must be a positive integer for model_type 'gpt_oss', got {value!r}")
    if k > experts:
        raise ConfigError(f"config.json: num_experts_per_tok={k} exceeds num_local_experts={experts}")
    types = d.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ConfigError(f"config.json: layer_types must list 'sliding_attention' or 'full_attention' for each of "
                          f"the {num_layers} layers, got {types!r}")
    window = d.get("sliding_window") or 0
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if sliding and (not isinstance(window, int) or window < 1):
        raise ConfigError(f"config.json: sliding_window must be a positive integer, got {window!r}")
    q = d.get("quantization_config")
    if q is not None:
        if not isinstance(q, dict) or q.get("quant_method") != "mxfp4":
            method = q.get("quant_method") if isinstance(q, dict) else q
            raise ConfigError(f"config.json: quantization_config.quant_method={method!r} is not supported for "
                              f"model_type 'gpt_oss' (supported: 'mxfp4', the experts as shipped)")
        if unknown := sorted(set(q) - {"quant_method", "modules_to_not_convert"}):
            raise ConfigError(f"config.json: quantization_config.{unknown[0]} is not supported for mxfp4")
    return dict(num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=int(d["intermediate_size"]),
                norm_topk_prob=True, moe_layers=tuple(range(num_layers)), attention_sinks=True,
                sliding_window=int(window), sliding_layers=sliding, moe_bias=True,
                swiglu_limit=float(d.get("swiglu_limit", 7.0)), swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
                mxfp4=q is not None)


_DTYPE_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
                "float": "float32"}


def _checkpoint_dtype(d: dict[str, Any]) -> str:
    """config.json's dtype (transformers 5) or torch_dtype (4.x), as one of jspec's dtype
    names; float32 when absent or not a float type jspec serves."""
    name = str(d.get("dtype") or d.get("torch_dtype") or "float32").removeprefix("torch.")
    return _DTYPE_NAMES.get(name, "float32")


def load_model_config(path: str | os.PathLike) -> ModelConfig:
    """Read ``PATH/config.json`` (or a config.json path) into a ModelConfig."""
    path = os.fspath(path)
    cfg_path = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not path.endswith(".json") and not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is not a directory")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"no config.json at {cfg_path}")
    return model_config_from_hf(read_json_object(cfg_path))


def read_json_object(path: str, error: type[ValueError] = ConfigError) -> dict[str, Any]:
    """The JSON object in the file ``path``. ``error`` (the caller's kind: a config or a
    checkpoint) names the file when it is not UTF-8 JSON or holds no object: json's own
    error names neither the file nor what was expected."""
    with open(path, encoding="utf-8") as f:
        try:
            d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise error(f"{path}: a JSON object expected, got {type(d).__name__}")
    return d
