"""Drafter configuration: the one place where a drafter checkpoint's config is translated.

Three config layouts are understood:
  - speculators (``speculators_model_type`` in {"eagle3", "peagle", "dflash"}): the
    drafter's decoder shape sits in ``transformer_layer_config``;
  - original EAGLE3 (``architectures: ["LlamaForCausalLMEagle3"]``): a flat Llama config
    plus ``draft_vocab_size`` (and sometimes ``target_hidden_size``, ``norm_before_residual``);
  - z-lab DFlash (``architectures: ["DFlashDraftModel"]`` with ``dflash_config``): a flat
    Qwen3 config plus ``block_size`` and ``dflash_config: {mask_token_id, target_layer_ids}``.

All target hidden-state indices in ``DrafterConfig.aux_layer_ids`` are *canonical*: c is the
residual stream entering target decoder layer c (c = 0 the embedding output, c = L the last
layer's output before the final norm), which is what ``Transformer(aux_layers=...)`` takes.
z-lab's ``target_layer_ids = t`` means "output of layer t", i.e. canonical t + 1.

Which tensors the checkpoint holds (own embeddings, d2t, PEagle's mask_hidden) is part of
the config, so the translation takes the checkpoint's tensor names too.

What is shared (the layout, the decoder shape, the vocabularies, the checks against the
target) is translated here; each method's own fields (``MethodFields``) by its module's
``Method.from_hf`` (jspec/drafters/registry.py lists the methods).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jspec.config import ConfigError, ModelConfig, RopeConfig, model_config_from_hf

# Layouts ("source formats") the loader knows how to read.
FMT_SPECULATORS = "speculators"
FMT_EAGLE3_ORIGINAL = "eagle3-original"
FMT_ZLAB_DFLASH = "zlab-dflash"

# Drafter-level keys of the flat (original EAGLE3 / z-lab DFlash) layouts; they are read
# below and must not reach the decoder-shape translation in jspec.config.
_FLAT_DRAFTER_KEYS = {
    "draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc",
    "eagle_aux_hidden_state_layer_ids", "block_size", "dflash_config", "num_target_layers",
    "auto_map", "num_speculative_tokens", "speculators_version",
}


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    method: str  # a name of jspec/drafters/registry.py: "eagle3" | "peagle" | "dflash" | "ngram" | "draft_model"
    source_format: str  # FMT_*: which weight layout the loader reads
    family: str  # "llama" | "qwen3": decoder-layer flavour (qwen3 has q_norm/k_norm)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    draft_vocab_size: int
    target_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # canonical target indices, in fc-input order
    norm_before_residual: bool  # EAGLE3 layer 0: residual is hidden_norm(h) (True) or h
    norm_before_fc: bool  # one RMSNorm over the concatenated aux states before fc
    has_own_embeddings: bool  # else the target's embedding table is passed in
    has_d2t: bool  # reduced draft vocab: target_id = i + d2t[i]
    mask_token_id: int | None  # PEagle / DFlash mask slots
    block_size: int | None  # DFlash
    num_speculative_tokens: int | None  # the checkpoint's proposal default, if it says
    qk_norm: bool
    attention_bias: bool
    mlp_bias: bool
    max_position_embeddings: int  # the drafter's own positions: no draft is proposed at or past it
    prompt_lookup_min: int | None = None  # "ngram" (jspec/drafters/ngram.py): the n-gram lengths matched
    prompt_lookup_max: int | None = None
    draft_model: ModelConfig | None = None  # "draft_model" (jspec/drafters/draft_model.py): the whole model's config

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def fc_in_features(self) -> int:
        return self.num_aux * self.target_hidden_size

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def uses_target_lm_head(self) -> bool:
        """DFlash with the full target vocab reads logits through the target's lm_head."""
        return self.method == "dflash" and not self.has_d2t

    def layer_config(self) -> ModelConfig:
        """The drafter's decoder-layer shape as a ModelConfig (for the shared layers)."""
        return ModelConfig(
            family=self.family,
            vocab_size=self.draft_vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope=self.rope,
            tie_word_embeddings=False,
            attention_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
            qk_norm=self.qk_norm,
        )


@dataclasses.dataclass(frozen=True)
class MethodFields:
    """The DrafterConfig fields a method's own translation decides (``Method.from_hf``); the
    shared translation (drafter_config_from_hf) decides the rest and checks these against
    the target."""

    aux_layer_ids: tuple[int, ...]  # canonical target indices, in fc-input order
    mask_token_id: int | None
    block_size: int | None
    num_speculative_tokens: int | None
    qk_norm: bool
    norm_before_residual: bool
    has_own_embeddings: bool


def layerless_config(method: str, target: ModelConfig, **fields) -> DrafterConfig:
    """The DrafterConfig of a method without a drafter model (no layers, no aux states,
    drafts in the target's vocabulary) on ``target``; ``fields``: its own (e.g. the n-gram
    lengths)."""
    return DrafterConfig(
        method=method, source_format="none", family=target.family, hidden_size=0, intermediate_size=0,
        num_layers=0, num_heads=0, num_kv_heads=0, head_dim=0, rms_norm_eps=target.rms_norm_eps,
        rope=target.rope, draft_vocab_size=target.vocab_size, target_vocab_size=target.vocab_size,
        target_hidden_size=target.hidden_size, aux_layer_ids=(), norm_before_residual=False,
        norm_before_fc=False, has_own_embeddings=False, has_d2t=False, mask_token_id=None, block_size=None,
        num_speculative_tokens=None, qk_norm=False, attention_bias=False, mlp_bias=False,
        max_position_embeddings=target.max_position_embeddings, **fields,
    )


def _drafter_layouts() -> dict:
    """The registry's methods that read a drafter config.json (``Method.from_hf``), by name."""
    from jspec.drafters.registry import REGISTRY  # the methods' modules import this one

    return {name: m for name, m in REGISTRY.items() if m.from_hf is not None}


def detect_format(d: dict[str, Any]) -> tuple[str, str]:
    """(method, source_format) of a drafter config.json dict."""
    archs = d.get("architectures") or []
    if "DFlash2DraftModel" in archs or d.get("speculators_model_type") == "dflash2":
        raise ConfigError(
            "config.json: DFlash2DraftModel / speculators_model_type 'dflash2' is a different "
            "architecture from DFlash and is not supported"
        )
    layouts = _drafter_layouts()
    smt = d.get("speculators_model_type")
    if smt is not None:
        if smt not in layouts:
            raise ConfigError(
                f"config.json: speculators_model_type={smt!r} is not supported (supported: {list(layouts)})"
            )
        return smt, FMT_SPECULATORS
    named = [(arch, name, fmt) for name, m in layouts.items() for arch, fmt in m.architectures]
    for arch, name, fmt in named:
        if arch in archs:
            return name, fmt
    raise ConfigError(
        f"config.json: not a recognised drafter (architectures={archs!r}, no speculators_model_type); "
        f"expected a speculators {'/'.join(layouts)} config, {' or '.join(a for a, _, _ in named)}"
    )


def _layer_shape(tl: dict[str, Any], where: str) -> ModelConfig:
    """Decoder shape from a (flat) HF layer config, through jspec.config's translation."""
    d = {k: v for k, v in tl.items() if k not in _FLAT_DRAFTER_KEYS and k != "architectures"}
    if d.get("layer_types") and any(t != "full_attention" for t in d["layer_types"]):
        raise ConfigError(f"{where}: layer_types {d['layer_types']} (sliding-window drafter layers) are not supported")
    try:
        return model_config_from_hf(d)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def proposal_tokens(d: dict[str, Any]) -> int | None:
    """The speculators config's default K (its default proposal method's, as vLLM reads it), or None."""
    sc = d.get("speculators_config") or {}
    methods = sc.get("proposal_methods") or []
    default = sc.get("default_proposal_method")
    for m in methods:
        if default is None or m.get("proposal_type") == default:
            if m.get("speculative_tokens") is not None:
                return int(m["speculative_tokens"])
    return None


def drafter_config_from_hf(
    d: dict[str, Any],
    target: ModelConfig,
    tensor_names: frozenset[str] | set[str],
) -> DrafterConfig:
    """Translate a drafter config.json dict (any supported layout) against its target.

    ``tensor_names``: the checkpoint's tensor names (tells own embeddings / d2t / mask_hidden).
    Raises ConfigError for unsupported layouts and ValueError for a drafter/target mismatch.
    """
    method, fmt = detect_format(d)
    if fmt == FMT_SPECULATORS:
        if "transformer_layer_config" not in d:
            raise ConfigError("config.json: speculators drafter without 'transformer_layer_config'")
        for flag in ("fc_norm", "norm_output", "sample_from_anchor", "sliding_window_non_causal"):
            if d.get(flag):
                raise ConfigError(f"config.json: {flag}=true is not supported")
        shape = _layer_shape(d["transformer_layer_config"], "config.json transformer_layer_config")
    else:
        shape = _layer_shape(d, "config.json")
    L = target.num_layers
    own = _drafter_layouts()[method].from_hf(d, fmt, shape, target, tensor_names)
    aux, mask_token_id = own.aux_layer_ids, own.mask_token_id

    draft_vocab = int(d.get("draft_vocab_size") or shape.vocab_size)
    target_vocab = shape.vocab_size
    target_hidden = int(d.get("target_hidden_size") or shape.hidden_size)
    has_d2t = draft_vocab != target_vocab
    if has_d2t and "d2t" not in tensor_names:
        raise ConfigError(
            f"checkpoint: draft_vocab_size={draft_vocab} != vocab_size={target_vocab} but there is no 'd2t' tensor"
        )

    # Drafter vs target.
    if target_hidden != target.hidden_size:
        raise ValueError(
            f"drafter expects target hidden size {target_hidden}, but the target has hidden_size={target.hidden_size}"
        )
    if target_vocab != target.vocab_size:
        raise ValueError(
            f"drafter was built for a target vocab of {target_vocab}, but the target has vocab_size={target.vocab_size}"
        )
    if not own.has_own_embeddings and shape.hidden_size != target.hidden_size:
        raise ValueError(
            f"drafter hidden_size={shape.hidden_size} shares the target's embeddings, "
            f"whose hidden size is {target.hidden_size}"
        )
    if not aux:
        raise ValueError("drafter has no aux hidden-state layer ids")
    bad = [c for c in aux if not 0 <= c <= L]
    if bad:
        raise ValueError(
            f"drafter aux layer ids {list(aux)} (canonical) have {bad} out of range [0, {L}] for a {L}-layer target"
        )
    if mask_token_id is not None and not 0 <= int(mask_token_id) < target.vocab_size:
        raise ValueError(f"mask_token_id={mask_token_id} is outside the target vocab [0, {target.vocab_size})")

    return DrafterConfig(
        method=method,
        source_format=fmt,
        family=shape.family,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rms_norm_eps=shape.rms_norm_eps,
        rope=shape.rope,
        draft_vocab_size=draft_vocab,
        target_vocab_size=target_vocab,
        target_hidden_size=target_hidden,
        aux_layer_ids=aux,
        norm_before_residual=own.norm_before_residual,
        norm_before_fc=bool(d.get("norm_before_fc", False)),
        has_own_embeddings=own.has_own_embeddings,
        has_d2t=has_d2t,
        mask_token_id=None if mask_token_id is None else int(mask_token_id),
        block_size=own.block_size,
        num_speculative_tokens=own.num_speculative_tokens,
        qk_norm=own.qk_norm,
        attention_bias=shape.attention_bias,
        mlp_bias=shape.mlp_bias,
        max_position_embeddings=shape.max_position_embeddings,
    )
