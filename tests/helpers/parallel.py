"""Tiny checkpoints for the tensor-parallel tests (tests/parallel/).

Two 2-layer targets, each with 8 query heads (tp up to 8 divides them) and 2 KV heads (the
KV cache is sharded at tp 2 and replicated at tp 4 and 8), vocabulary 64, intermediate 96:
  llama  Llama (head_dim 8)
  qwen3  Qwen3 (q_norm / k_norm, head_dim 16 != hidden / heads)
(untied: a tied table would carry the planted boost into the residual stream; the tied
lm_head is covered by tests/parallel/test_tp_model.py on tests/helpers/targets.py's target)
and over each, EAGLE3 (reduced draft vocabulary + d2t; "eagle3_full": the whole vocabulary),
PEagle (own embeddings, mask_hidden) and DFlash (block 4, reduced vocabulary, own lm_head;
"dflash_full": the target's lm_head) drafters of 4 heads, and a Qwen3 of the same shape as
an ordinary draft model ("draft_model"). Every builder takes the target's ``vocab`` (64 by
default; a reduced draft vocabulary is 16 smaller): tests/parallel/test_tp_vocab.py builds
the same models over vocabularies tensor parallelism does not divide. The targets carry
spec_e2e's planted feature (its docstring) so drafts are accepted: acceptance is not the
point here, but it exercises the accept paths of the sharded step.
"""

from __future__ import annotations

import os

import torch

from tests.helpers import spec_e2e as e2e
from tests.helpers.buckets import bucket_mode
from tests.helpers.drafters import fill_random, speculators_config

V, H, L, HEADS, KVH = 64, 64, 2, 8, 2
AUX = [1, 2]  # canonical aux ids of the EAGLE3 / PEagle drafters
DRAFT_VOCAB = 48  # a reduced draft vocabulary: V - 16
A_TARGET = 4.5  # the planted boost of token X (spec_e2e.A_TARGET; ~30% of greedy tokens X at 2 layers)
DRAFTERS = {"eagle3": "eagle3", "eagle3_full": "eagle3", "peagle": "peagle", "dflash": "dflash",
            "dflash_full": "dflash"}  # name -> method

_CACHE: dict = {}


def _root() -> str:
    return e2e._root()


def _suffix(vocab: int) -> str:
    return "" if vocab == V else f"_v{vocab}"


def build_target(kind: str, seed: int = 0, boost: float = A_TARGET, vocab: int = V):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=H, intermediate_size=96, num_hidden_layers=L, num_attention_heads=HEADS,
              num_key_value_heads=KVH, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        m = LlamaForCausalLM(LlamaConfig(**kw, head_dim=8, tie_word_embeddings=False)).eval()
    else:
        m = Qwen3ForCausalLM(Qwen3Config(**kw, head_dim=16, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        fill_random(m, scale=0.15)
        m.model.embed_tokens.weight[:, e2e.F] = e2e.C_EMBED
        e2e._carry_feature(m.model.layers, hide=True)
        m.lm_head.weight[e2e.X, e2e.F] += boost
    return m


def target(kind: str, vocab: int = V):
    """(folder, torch model) of target ``kind`` ("llama" | "qwen3") over ``vocab`` tokens, built once."""
    key = ("target", kind, vocab)
    if key not in _CACHE:
        m = build_target(kind, vocab=vocab)
        folder = os.path.join(_root(), f"tp_{kind}{_suffix(vocab)}")
        m.save_pretrained(folder)
        _CACHE[key] = (folder, m)
    return _CACHE[key]


def drafter(kind: str, name: str, vocab: int = V) -> str:
    """Folder of drafter ``name`` (DRAFTERS, or "draft_model") over target ``kind`` of ``vocab`` tokens."""
    key = ("drafter", kind, name, vocab)
    if key in _CACHE:
        return _CACHE[key]
    _, hf = target(kind, vocab)
    folder = os.path.join(_root(), f"tp_{kind}_{name}{_suffix(vocab)}")
    if name == "draft_model":  # the planted feature, boosted as the drafters' (drafts X nearly always)
        build_target("qwen3", seed=5, boost=e2e.B_DRAFT, vocab=vocab).save_pretrained(folder)
        _CACHE[key] = folder
        return folder
    cfg = lambda method, layers, k, **kw: speculators_config(method, "llama" if method != "dflash" else "qwen3",  # noqa: E731
                                                              layers, k, vocab=vocab, hidden=H, **kw)
    reduced = vocab - (V - DRAFT_VOCAB)
    rand = lambda model, draft_vocab, seed: e2e._randomize(model, hf, draft_vocab, seed=seed, fc_col=e2e.F,  # noqa: E731
                                                            vocab=vocab)
    if name in ("eagle3", "eagle3_full"):
        from speculators.models import Eagle3DraftModel

        dv = reduced if name == "eagle3" else vocab
        sc = cfg("eagle3", 1, 3, draft_vocab_size=dv, norm_before_residual=True, eagle_aux_hidden_state_layer_ids=AUX)
        model = rand(Eagle3DraftModel(sc), dv, 1 if name == "eagle3" else 4)
    elif name == "peagle":
        from speculators.models import PEagleDraftModel

        sc = cfg("peagle", 2, 3, draft_vocab_size=vocab, eagle_aux_hidden_state_layer_ids=AUX, mask_token_id=e2e.MASK)
        model = rand(PEagleDraftModel(sc), vocab, 2)
    elif name in ("dflash", "dflash_full"):
        from speculators.models.dflash import DFlashDraftModel

        dv = reduced if name == "dflash" else vocab  # the whole vocabulary: the target's lm_head
        sc = cfg("dflash", 1, 3, draft_vocab_size=dv, mask_token_id=e2e.MASK, block_size=4,
                 aux_hidden_state_layer_ids=AUX)
        model = rand(DFlashDraftModel(sc), dv, 7 if name == "dflash" else 8)
    else:
        raise KeyError(name)
    model.save_pretrained(folder)
    _CACHE[key] = folder
    return folder


def spec_config(kind: str, name: str | None, vocab: int = V, **extra) -> dict | None:
    if name is None:
        return None
    if name == "ngram":  # no checkpoint; the token history replicated on every device
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3, **extra}
    if name == "draft_model":  # an ordinary Qwen3 of the same vocabulary and 8 heads, sharded as the target
        return {"method": "draft_model", "model": drafter(kind, name, vocab), "num_speculative_tokens": 3, **extra}
    return {"method": DRAFTERS[name], "model": drafter(kind, name, vocab), **extra}


# One compiled shape per step kind wherever possible (CPU compiles dominate the folder's
# time): a page of 64 tokens holds every sequence (page-table width 1), one prefill chunk
# bucket (16), two rows.
ENGINE_KW = dict(max_num_seqs=2, max_model_len=48, page_size=64, max_prefill_chunk=16, max_num_batched_tokens=32)


def llm(kind: str, name: str | None, tp: int, draft_tp: int | None = None, vocab: int = V, **kw):
    """A jspec.LLM over target ``kind`` of ``vocab`` tokens (with drafter ``name``) at
    tensor parallel size ``tp``, cached per configuration for the session. Speculative
    engines run without async scheduling (one compiled verification shape instead of two)."""
    import jspec

    # EAGLE3 drafts K = 2 (one fed-back step; its K = 3 step took half again as long to compile).
    extra = {"num_speculative_tokens": 2} if name in ("eagle3", "eagle3_full") else {}
    if draft_tp is not None:
        extra["draft_tensor_parallel_size"] = draft_tp
    args = {**ENGINE_KW, **({"async_scheduling": False} if name else {}), **kw}
    key = ("llm", kind, name, tp, draft_tp, vocab, tuple(sorted(args.items())), bucket_mode())
    if key not in _CACHE:
        folder, _ = target(kind, vocab)
        _CACHE[key] = jspec.LLM(folder, speculative_config=spec_config(kind, name, vocab, **extra),
                                tensor_parallel_size=tp, **args)
    return _CACHE[key]


def prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = V) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(8, vocab, size=int(k))] for k in np.linspace(lo, hi, n).round()]


def generate(llm, prompts, max_tokens: int, **sp) -> list[list[int]]:
    import jspec

    params = jspec.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **{"temperature": 0.0, **sp})
    return [o.token_ids for o in llm.generate(prompts, params)]
