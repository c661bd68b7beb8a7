"""Shared pieces of the drafter parity tests: tiny targets, speculators drafters, references.

The references run speculators' own PyTorch modules (embeddings, fc, decoder layers,
norms, lm_head) with eager attention and an explicit mask, so they are the package's maths
at inference time (its ``forward`` methods are training loops with anchor sampling).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import torch

from jspec.checkpoint.target import load_target
from jspec.drafters import DFlashDrafter, Eagle3Drafter, PEagleDrafter, create_kv_cache
from jspec.drafters.propose import span_metadata
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.transformer import Transformer

H, V, HEADS, KVH, HD = 64, 256, 4, 2, 16
PAGE, NPAGES = 4, 16
PAGES = [3, 7, 1, 9, 2, 5, 11, 0, 4, 6, 8, 10, 12, 13, 14, 15]


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make_target(folder, family: str, num_layers: int):
    """A random tiny HF target saved to ``folder``; returns (hf_model, ModelConfig, params)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    kw = dict(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=num_layers,
              num_attention_heads=HEADS, num_key_value_heads=KVH, head_dim=HD, tie_word_embeddings=False)
    m = (LlamaForCausalLM(LlamaConfig(**kw)) if family == "llama" else Qwen3ForCausalLM(Qwen3Config(**kw))).eval()
    m.save_pretrained(folder)
    cfg, params = load_target(folder, "float32")
    return m, cfg, params


def target_aux(cfg, params, ids, aux_layers) -> np.ndarray:
    """f32[T, n * H]: the target's canonical aux states for ``ids`` (jspec forward)."""
    kv = KVCache.create(cfg.num_layers, NPAGES, PAGE, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    meta = AttentionMetadata.for_single_sequence(PAGES, PAGE, 0, len(ids), NPAGES)
    _, aux, _ = Transformer(cfg).apply({"params": params}, jnp.asarray(ids[None]), meta, kv, aux_layers=tuple(aux_layers))
    return np.asarray(aux[0]).reshape(len(ids), -1)


def eagle3_first_pass(cfg, params, tparams, tokens, aux):
    """jspec's EAGLE3 drafter over the pairs (tokens[t], target aux state t), t = 0..T-1:
    (logits f32[T, Vd], the pre-norm hidden states [T, H])."""
    kv = create_kv_cache(cfg, NPAGES, PAGE, jnp.float32)
    meta = AttentionMetadata.for_single_sequence(PAGES, PAGE, 0, len(tokens), NPAGES)
    m = Eagle3Drafter(cfg)
    h, kv = m.apply({"params": params}, jnp.asarray(tokens[None]), jnp.asarray(aux[None]), meta, kv,
                    tparams["embed_tokens"]["embedding"], hidden_is_fc_input=True)
    return np.asarray(m.apply({"params": params}, h, method=Eagle3Drafter.logits)[0]), np.asarray(h[0])


def peagle_mask_slot_logits(cfg, params, tokens, rows, is_mask):
    """jspec's PEagle drafter in one forward over `tokens` (pairs, then mask slots) with their
    fc input rows [n, 3H] and mask-slot flags [n]: logits f32[n, Vd]."""
    kv = create_kv_cache(cfg, NPAGES, PAGE, jnp.float32)
    meta = AttentionMetadata.for_single_sequence(PAGES, PAGE, 0, len(tokens), NPAGES)
    m = PEagleDrafter(cfg)
    h, _ = m.apply({"params": params}, jnp.asarray(tokens[None]), jnp.asarray(rows[None]), meta, kv, None,
                   hidden_is_fc_input=True, mask_slots=jnp.asarray(is_mask[None]))
    return np.asarray(m.apply({"params": params}, h, method=PEagleDrafter.logits)[0])


def dflash_block_logits(cfg, params, tparams, aux, bonus):
    """jspec's DFlash drafter: the context's aux states [T, n * H] written, then the block
    [bonus, mask x (block_size - 1)] at positions T.. -> logits f32[block_size, Vd]."""
    T, bs = len(aux), cfg.block_size
    kv = create_kv_cache(cfg, NPAGES, PAGE, jnp.float32)
    m = DFlashDrafter(cfg)
    v = {"params": params}
    ctx_meta = AttentionMetadata.for_single_sequence(PAGES, PAGE, 0, T, NPAGES)
    kv = m.apply(v, jnp.asarray(aux[None]), ctx_meta, kv, method=DFlashDrafter.write_context)
    block = span_metadata(ctx_meta.page_table, jnp.asarray([T]), bs, jnp.asarray([True]), PAGE, NPAGES, causal=False)
    tokens = jnp.asarray([[bonus] + [cfg.mask_token_id] * (bs - 1)])
    h, _ = m.apply(v, tokens, block, kv, tparams["embed_tokens"]["embedding"])
    return np.asarray(m.apply(v, h, tparams["lm_head"], method=DFlashDrafter.logits)[0])


def speculators_config(kind: str, family: str, num_layers: int, k: int, *, vocab=V, hidden=H, **kw):
    """A speculators config (eagle3 | peagle | dflash) with a tiny decoder layer config."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.peagle import PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig, Qwen3Config

    lkw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=80, num_hidden_layers=num_layers,
               num_attention_heads=HEADS, num_key_value_heads=KVH, head_dim=HD, rms_norm_eps=1e-6)
    tl = LlamaConfig(**lkw) if family == "llama" else Qwen3Config(**lkw)
    tl._attn_implementation = "eager"
    sc = SpeculatorsConfig(
        algorithm=kind, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=k)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
    )
    cls = {"eagle3": Eagle3SpeculatorConfig, "peagle": PEagleSpeculatorConfig, "dflash": DFlashSpeculatorConfig}[kind]
    return cls(transformer_layer_config=tl, speculators_config=sc, **kw)


def fill_random(model, generator=None, norm_spread: float = 0.1, scale: float = 0.15):
    """Random weights in place (under torch.no_grad): norm gains 1 + norm_spread * N(0, 1),
    every other weight scale * N(0, 1); speculators' frozen ``verifier_*`` copies are left
    alone. generator None draws from torch's global RNG (seed it first)."""
    for name, p in model.named_parameters():
        if name.startswith("verifier_"):
            continue
        noise = torch.randn(p.shape, generator=generator)
        p.copy_(1.0 + norm_spread * noise if name.endswith("norm.weight") else scale * noise)


def set_vocab_map(model, tgt, vocab: int):
    """A reduced draft vocabulary: draft id i is target id tgt[i] (tgt sorted, numpy) of a
    target vocabulary of `vocab` tokens."""
    d2t = torch.tensor(tgt - np.arange(len(tgt)), dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.tensor(tgt)] = True
    model.load_vocab_mappings(t2d, d2t)


def randomize(model, target_hf, draft_vocab: int, seed: int):
    """Random weights everywhere (norm gains around 1), target embeddings, a d2t map if reduced."""
    with torch.no_grad():
        fill_random(model, torch.Generator().manual_seed(seed), norm_spread=0.2)
        model.embed_tokens.weight.copy_(target_hf.model.embed_tokens.weight)
        if draft_vocab != V:
            rng = np.random.RandomState(seed)
            set_vocab_map(model, np.sort(rng.choice(V, draft_vocab, replace=False)), V)
        elif hasattr(model, "lm_head") and model.config.speculators_model_type == "dflash":
            model.lm_head.weight.copy_(target_hf.lm_head.weight)
    model.eval()
    return model


def causal_mask(positions) -> torch.Tensor:  # additive float [1, 1, T, T], by position
    p = torch.as_tensor(np.asarray(positions))
    ok = p[None, :] <= p[:, None]
    return torch.where(ok, 0.0, torch.finfo(torch.float32).min)[None, None]


@torch.no_grad()
def ref_eagle3(model, ids, h, positions, mask_slots=None):
    """speculators EAGLE3/PEagle over pairs (ids[t], h[t]) at ``positions``, causal by position.

    h: f32[T, n*H] rows go through (input_norm,) fc, except rows given as already-projected
    [T, H] (the feedback of later steps): pass h as a tuple (fc_rows [T, n*H] | None, direct [T, H] | None, is_direct bool[T]).
    Returns (logits [T, Vd], pre-norm out [T, H]).
    """
    fc_rows, direct, is_direct = h
    T = len(ids)
    hid = torch.zeros(T, model.hidden_size)
    if fc_rows is not None:
        x = torch.tensor(np.asarray(fc_rows, np.float32))[None]
        if mask_slots is not None:
            x = torch.where(torch.as_tensor(mask_slots)[None, :, None], model.mask_hidden.expand(1, T, -1), x)
        if model.input_norm is not None:
            x = model.input_norm(x)
        hid = model.fc(x)[0]
    if direct is not None:
        hid = torch.where(torch.as_tensor(is_direct)[:, None], torch.tensor(np.asarray(direct, np.float32)), hid)
    e = model.embed_tokens(torch.as_tensor(np.asarray(ids))[None])
    x = torch.cat([e, hid[None]], dim=-1)
    pos = torch.as_tensor(np.asarray(positions))[None]
    pe = model.rotary_emb(x, pos)
    mask = causal_mask(positions)
    for layer in model.layers:
        x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    return model.lm_head(model.norm(x))[0].numpy(), x[0].numpy()


@torch.no_grad()
def ref_dflash(model, ctx_h, ctx_pos, block_ids, block_pos):
    """speculators DFlash: one block over the context; returns logits [bs, Vd]."""
    ctx = model.hidden_norm(model.fc(torch.tensor(np.asarray(ctx_h, np.float32))[None]))
    x = model.embed_tokens(torch.as_tensor(np.asarray(block_ids))[None])
    pos = torch.as_tensor(np.concatenate([ctx_pos, block_pos]))[None]
    pe = model.rotary_emb(x, pos)
    for layer in model.layers:
        x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_ids=pos, position_embeddings=pe)
    return model.lm_head(model.norm(x))[0].numpy()


def speculators_from_folder(folder, target_folder):
    """speculators' PyTorch module from a trained folder (eager attention; the verifier
    path, left null in the shipped config, pointed at the target, whose lm_head DFlash uses)."""
    from safetensors.torch import load_file
    from speculators import SpeculatorModel, SpeculatorModelConfig

    cfg = SpeculatorModelConfig.from_pretrained(folder)
    cfg.speculators_config.verifier.name_or_path = target_folder
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(folder, config=cfg).float().eval()
    if "embed_tokens.weight" not in load_file(os.path.join(folder, "model.safetensors")):
        # A checkpoint without embeddings drafts with the target's (as vLLM and jspec do);
        # speculators only fills them from the verifier when they are NaN.
        with torch.no_grad():
            emb = load_file(os.path.join(target_folder, "model.safetensors"))["model.embed_tokens.weight"]
            model.embed_tokens.weight.copy_(emb)
    return model
