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
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jspec.config import ConfigError, ModelConfig, RopeConfig, model_config_from_hf

METHODS = ("eagle3", "peagle", "dflash")
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
    method: str  # "eagle3" | "peagle" | "dflash" | "ngram" (ngram.ngram_config) | "draft_model" (draft_model.py)
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


def detect_format(d: dict[str, Any]) -> tuple[str, str]:
    """(method, source_format) of a drafter config.json dict."""
    archs = d.get("architectures") or []
    if "DFlash2DraftModel" in archs or d.get("speculators_model_type") == "dflash2":
        raise ConfigError(
            "config.json: DFlash2DraftModel / speculators_model_type 'dflash2' is a different "
            "architecture from DFlash and is not supported"
        )
    smt = d.get("speculators_model_type")
    if smt is not None:
        if smt not in METHODS:
            raise ConfigError(
                f"config.json: speculators_model_type={smt!r} is not supported (supported: {list(METHODS)})"
            )
        return smt, FMT_SPECULATORS
    if "LlamaForCausalLMEagle3" in archs:
        return "eagle3", FMT_EAGLE3_ORIGINAL
    if "DFlashDraftModel" in archs:
        return "dflash", FMT_ZLAB_DFLASH
    raise ConfigError(
        f"config.json: not a recognised drafter (architectures={archs!r}, no speculators_model_type); "
        "expected a speculators eagle3/peagle/dflash config, LlamaForCausalLMEagle3 or DFlashDraftModel"
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


def _proposal_tokens(d: dict[str, Any]) -> int | None:
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
        top = d
    else:
        shape = _layer_shape(d, "config.json")
        top = d
    L = target.num_layers

    if method == "dflash":
        if fmt == FMT_ZLAB_DFLASH:
            dc = d.get("dflash_config") or {}
            if dc.get("target_layer_ids") is None:
                raise ConfigError("config.json: dflash_config.target_layer_ids is missing (DFlash needs explicit layer ids)")
            # z-lab: "output of layer t" = canonical t + 1.
            aux = tuple(int(t) + 1 for t in dc["target_layer_ids"])
            mask_token_id = dc.get("mask_token_id")
        else:
            if top.get("aux_hidden_state_layer_ids") is None:
                raise ConfigError("config.json: aux_hidden_state_layer_ids is missing (DFlash needs explicit layer ids)")
            aux = tuple(int(c) for c in top["aux_hidden_state_layer_ids"])
            mask_token_id = top.get("mask_token_id")
        if "block_size" not in top:
            raise ConfigError("config.json: DFlash drafter without 'block_size'")
        block_size = int(top["block_size"])
        if block_size < 2:
            raise ConfigError(f"config.json: block_size={block_size} must be >= 2")
        if mask_token_id is None:
            raise ConfigError("config.json: DFlash drafter without mask_token_id")
        # The speculators format names its default K, as vLLM reads it (proposal_methods[0]);
        # z-lab's drafts the whole block. Either way the drafter runs its trained block.
        num_spec = _proposal_tokens(top) if fmt == FMT_SPECULATORS else None
        if num_spec is None:
            num_spec = block_size - 1
        elif not 1 <= num_spec <= block_size - 1:
            raise ConfigError(f"config.json: speculative_tokens={num_spec} must be in 1..block_size - 1 "
                              f"({block_size - 1}): a DFlash drafter drafts from one block")
        # DFlash layers are always Qwen3-style (q_norm / k_norm), whatever model_type says.
        qk_norm = True
        norm_before_residual = False
    else:
        ids = top.get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(int(c) for c in ids) if ids is not None else target.default_aux_layers()
        mask_token_id = top.get("mask_token_id") if method == "peagle" else None
        if method == "peagle":
            if mask_token_id is None:
                raise ConfigError("config.json: PEagle drafter without mask_token_id")
            if "mask_hidden" not in tensor_names:
                raise ConfigError("checkpoint: PEagle drafter without the 'mask_hidden' tensor")
        block_size = None
        num_spec = _proposal_tokens(top)
        qk_norm = shape.qk_norm
        # Key absent: True for eagle3, False for peagle (vLLM's defaults).
        norm_before_residual = bool(top.get("norm_before_residual", method == "eagle3"))

    draft_vocab = int(top.get("draft_vocab_size") or shape.vocab_size)
    target_vocab = shape.vocab_size
    target_hidden = int(top.get("target_hidden_size") or shape.hidden_size)
    has_d2t = draft_vocab != target_vocab
    if has_d2t and "d2t" not in tensor_names:
        raise ConfigError(
            f"checkpoint: draft_vocab_size={draft_vocab} != vocab_size={target_vocab} but there is no 'd2t' tensor"
        )
    has_own_embeddings = method != "dflash" and "embed_tokens.weight" in tensor_names

    # Drafter vs target.
    if target_hidden != target.hidden_size:
        raise ValueError(
            f"drafter expects target hidden size {target_hidden}, but the target has hidden_size={target.hidden_size}"
        )
    if target_vocab != target.vocab_size:
        raise ValueError(
            f"drafter was built for a target vocab of {target_vocab}, but the target has vocab_size={target.vocab_size}"
        )
    if not has_own_embeddings and shape.hidden_size != target.hidden_size:
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
        norm_before_residual=norm_before_residual,
        norm_before_fc=bool(top.get("norm_before_fc", False)),
        has_own_embeddings=has_own_embeddings,
        has_d2t=has_d2t,
        mask_token_id=None if mask_token_id is None else int(mask_token_id),
        block_size=block_size,
        num_speculative_tokens=num_spec,
        qk_norm=qk_norm,
        attention_bias=shape.attention_bias,
        mlp_bias=shape.mlp_bias,
        max_position_embeddings=shape.max_position_embeddings,
    )
