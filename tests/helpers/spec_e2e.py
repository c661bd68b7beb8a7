"""Builders for the end-to-end speculative tests (tests/e2e/test_spec_*.py).

One tiny untied Llama target (vocab 64) and drafters of every method and layout, written
once per session with transformers / speculators ``save_pretrained``:

  eagle3        speculators EAGLE3, 1 layer, reduced draft vocab (48 of 64) + d2t
  eagle3_full   speculators EAGLE3, 1 layer, full draft vocabulary (no d2t)
  eagle3_orig   the eagle3 weights converted to the original LlamaForCausalLMEagle3 layout
  peagle        speculators PEagle, 2 layers, full vocab, own embeddings, mask_hidden
  dflash4       speculators DFlash, block_size 4 (K = 3), reduced vocab + own lm_head
  dflash8_zlab  a block_size 8 (K = 7) DFlash converted to z-lab's DFlashDraftModel layout
  draft_llama   an ordinary 2-layer Llama of the same vocabulary (method "draft_model")
and the n-gram method ("ngram"), which has no checkpoint.

Engineered agreement (why acceptance is not ~0 with random weights)
------------------------------------------------------------------
A random drafter never agrees with a random target, so every draft would be rejected and a
"lossless" test would only exercise the reject-at-position-0 path. We plant one *shared
feature* honestly, through the weights only (no engine hooks):
  - column F of the target's embedding table is a constant C for every token, and no
    target layer reads or writes residual dimension F (zero norm gains / output rows at F),
    so the residual stream -- and every aux hidden state the drafters read -- carries
    exactly C along F;
  - the target's lm_head row X gets + A * e_F: X becomes the target's argmax in a fraction
    of contexts (A is tuned so greedy outputs are roughly a third to a half X, not all X);
  - each drafter routes that component to its own output (fc row F reads aux column F;
    PEagle's mask_hidden carries it too; DFlash's block is embedded with the target's
    embeddings; its layers do not write F either) and its lm_head row for X gets
    + B * e_F, so it drafts X most of the time ("_soft" variants: a mild B, spread q).
Acceptance lengths then vary between 1 and K + 1 (runs of X), exercising the accept, the
reject-at-position-i and the bonus paths. Tests assert mean acceptance length > 1.3 so
they cannot pass vacuously.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from jspec.engine.sequence import spec_stats_delta as stats_delta  # noqa: F401 (the tests' h.stats_delta)
from tests.helpers.buckets import bucket_mode
from tests.helpers.drafters import fill_random, set_vocab_map, speculators_config

V, H, HEADS, KVH, HD, L = 64, 64, 4, 2, 16, 4
AUX = [1, 2, 4]  # canonical target layer ids read by the EAGLE3 / PEagle drafters
DFLASH_AUX = [1, 3]
F = 5  # the shared feature dimension
X = 7  # the token both sides like
C_EMBED = 1.0  # embedding value along F
A_TARGET = 9.0  # target lm_head row X boost along F (tuned: X ~ 45% of greedy tokens)
B_SOFT = 3.0  # the '_soft' drafters' boost
B_DRAFT = 20.0  # drafter lm_head row X boost along F
MASK = 3  # PEagle / DFlash mask token id
DRAFT_VOCAB = 48
FC_GAIN = 10.0  # drafter fc: residual F = FC_GAIN * C (the other fc outputs have rms ~ 4)

_CACHE: dict = {}


def _root() -> str:
    if "root" not in _CACHE:
        import atexit
        import shutil
        import tempfile

        _CACHE["root"] = tempfile.mkdtemp(prefix="jspec_spec_e2e_")
        atexit.register(shutil.rmtree, _CACHE["root"], ignore_errors=True)
    return _CACHE["root"]


def build_target(seed: int = 0, scale: float = 0.15, num_layers: int = L, boost: float = A_TARGET):
    """The tiny Llama target (torch module, eval) with the planted feature (also, with fewer
    layers and a stronger boost, the draft model of method "draft_model")."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=num_layers,
                      num_attention_heads=HEADS, num_key_value_heads=KVH, head_dim=HD,
                      max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        fill_random(m, scale=scale)
        m.model.embed_tokens.weight[:, F] = C_EMBED
        _carry_feature(m.model.layers, hide=True)
        m.lm_head.weight[X, F] += boost
    return m


def _carry_feature(layers, hide: bool):
    """Decoder layers leave residual dimension F alone (no writes; with ``hide``, no reads)."""
    for layer in layers:
        layer.self_attn.o_proj.weight[F, :] = 0.0
        layer.mlp.down_proj.weight[F, :] = 0.0
        if hide:
            layer.input_layernorm.weight[F] = 0.0
            layer.post_attention_layernorm.weight[F] = 0.0


def target():
    """(folder, torch model) of the shared target."""
    if "target" not in _CACHE:
        m = build_target()
        folder = os.path.join(_root(), "target")
        m.save_pretrained(folder)
        _CACHE["target"] = (folder, m)
    return _CACHE["target"]


def _spec_config(kind: str, family: str, num_layers: int, k: int, **kw):
    # The parity tests' builder at this module's vocab and width (heads, head_dim as there).
    return speculators_config(kind, family, num_layers, k, vocab=V, hidden=H, **kw)


def _randomize(model, target_hf, draft_vocab: int, seed: int, fc_col: int | None, boost: float = B_DRAFT,
               vocab: int = V):
    """Random weights, target embeddings, a d2t map if reduced (of a target vocabulary of
    ``vocab`` tokens), and the planted feature."""
    with torch.no_grad():
        fill_random(model, torch.Generator().manual_seed(seed))
        if hasattr(model, "embed_tokens"):
            model.embed_tokens.weight.copy_(target_hf.model.embed_tokens.weight)
        x_row = X
        if draft_vocab != vocab:
            rng = np.random.RandomState(seed)
            others = np.setdiff1d(np.arange(vocab), [X])
            tgt = np.sort(np.concatenate([[X], rng.choice(others, draft_vocab - 1, replace=False)]))
            set_vocab_map(model, tgt, vocab)
            x_row = int(np.nonzero(tgt == X)[0][0])
        # Route the shared feature: fc output F reads aux column fc_col (the feature in the
        # first aux state), and the drafter's X row looks along F.
        if fc_col is not None:
            model.fc.weight[F, :] = 0.0
            model.fc.weight[F, fc_col] = FC_GAIN
        _carry_feature(model.layers, hide=False)
        if hasattr(model, "mask_hidden"):
            model.mask_hidden[..., fc_col] = C_EMBED
        model.lm_head.weight[x_row, F] += boost
    model.eval()
    return model


def drafter(name: str) -> str:
    """Folder of drafter ``name`` (see the module docstring), built once per session."""
    key = ("drafter", name)
    if key in _CACHE:
        return _CACHE[key]
    _, hf = target()
    folder = os.path.join(_root(), name)
    # "<name>_soft": the same drafter with a mild X boost, so its draft distribution q is
    # spread out (for the probabilistic-draft distribution tests).
    boost = B_SOFT if name.endswith("_soft") else B_DRAFT
    name = name.removesuffix("_soft")
    if name == "eagle3":
        from speculators.models import Eagle3DraftModel

        sc = _spec_config("eagle3", "llama", 1, 3, draft_vocab_size=DRAFT_VOCAB, norm_before_residual=True,
                          eagle_aux_hidden_state_layer_ids=AUX)
        _randomize(Eagle3DraftModel(sc), hf, DRAFT_VOCAB, seed=1, fc_col=F, boost=boost).save_pretrained(folder)
    elif name == "eagle3_full":  # full draft vocabulary: no d2t / t2d maps
        from speculators.models import Eagle3DraftModel

        sc = _spec_config("eagle3", "llama", 1, 3, draft_vocab_size=V, norm_before_residual=True,
                          eagle_aux_hidden_state_layer_ids=AUX)
        _randomize(Eagle3DraftModel(sc), hf, V, seed=4, fc_col=F, boost=boost).save_pretrained(folder)
    elif name == "eagle3_orig":
        from jspec.drafters.convert import speculators_eagle3_to_original

        speculators_eagle3_to_original(drafter("eagle3"), folder)
    elif name == "peagle":
        from speculators.models import PEagleDraftModel

        sc = _spec_config("peagle", "llama", 2, 3, draft_vocab_size=V, eagle_aux_hidden_state_layer_ids=AUX,
                          mask_token_id=MASK)
        _randomize(PEagleDraftModel(sc), hf, V, seed=2, fc_col=F, boost=boost).save_pretrained(folder)
    elif name.startswith("dflash"):
        from speculators.models.dflash import DFlashDraftModel

        bs = int(name[len("dflash")])
        sc = _spec_config("dflash", "qwen3", 1, bs - 1, draft_vocab_size=DRAFT_VOCAB, mask_token_id=MASK,
                          block_size=bs, aux_hidden_state_layer_ids=DFLASH_AUX)
        # The block is embedded with the target's embeddings (feature F included) and the
        # residual carries it to the output; fc's F row reads the first aux state's F too.
        model = _randomize(DFlashDraftModel(sc), hf, DRAFT_VOCAB, seed=3 + bs, fc_col=F, boost=boost)
        if name.endswith("_zlab"):
            from jspec.drafters.convert import speculators_dflash_to_zlab

            tmp = folder + "_speculators"
            model.save_pretrained(tmp)
            speculators_dflash_to_zlab(tmp, folder)
        else:
            model.save_pretrained(folder)
    elif name == "draft_llama":  # an ordinary 2-layer Llama of the target's vocabulary ("draft_model")
        build_target(seed=9, num_layers=2, boost=B_DRAFT).save_pretrained(folder)
    else:
        raise KeyError(name)
    _CACHE[key] = folder
    return folder


METHOD = {"eagle3": "eagle3", "eagle3_full": "eagle3", "eagle3_orig": "eagle3", "eagle3_soft": "eagle3",
          "peagle": "peagle",
          "peagle_soft": "peagle", "dflash4": "dflash", "dflash4_soft": "dflash", "dflash8_zlab": "dflash",
          "ngram": "ngram", "draft_llama": "draft_model"}


def spec_config(name: str, k: int | None = None, **extra) -> dict:
    # "ngram": vLLM's prompt lookup, no checkpoint; n-grams of 1..3 tokens (the tiny vocabulary
    # repeats short ones)
    d = ({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3} if name == "ngram"
         else {"method": METHOD[name], "model": drafter(name)})
    if k is not None:
        d["num_speculative_tokens"] = k
    d.update(extra)
    return d


# Small engines, few compiled shapes: batch buckets {1, 2}, one prefill width (16) and one
# page-table width (4 pages: (56 + lookahead <= 8) / 16). Six pages for two sequences of up
# to four pages each: the pool is tight, so long sequences wait or get preempted.
ENGINE_KW = dict(max_num_seqs=2, max_model_len=56, page_size=16, max_prefill_chunk=16, max_num_batched_tokens=32,
                 num_pages=6)


def llm(name: str | None, k: int | None = None, *, spec_extra: dict | None = None, **kw):
    """A jspec.LLM over the shared target, cached per configuration for the session."""
    import jspec

    args = {**ENGINE_KW, **kw}
    key = ("llm", name, k, tuple(sorted((spec_extra or {}).items())), tuple(sorted(args.items())), bucket_mode())
    if key not in _CACHE:
        folder, _ = target()
        sc = None if name is None else spec_config(name, k, **(spec_extra or {}))
        # compiled on first use, as on the CPU (gpu_check builds dozens of engines on the GPU)
        _CACHE[key] = jspec.LLM(folder, speculative_config=sc, **{"warmup": False, **args})
    return _CACHE[key]


def varied_prompts(n: int, lo: int = 1, hi: int = 60, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = np.linspace(lo, hi, n).round().astype(int)
    rng.shuffle(lens)
    return [[int(t) for t in rng.integers(8, V, size=int(n_))] for n_ in lens]


def greedy_reference(prompts, max_tokens: int) -> list[list[int]]:
    """Greedy outputs of the target without speculation and without prefix caching (memoised)."""
    import jspec

    memo = _CACHE.setdefault("greedy_memo", {})
    todo = [p for p in prompts if (tuple(p), max_tokens) not in memo]
    if todo:
        eng = llm(None, enable_prefix_caching=False)
        sp = jspec.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for p, o in zip(todo, eng.generate(todo, sp)):
            memo[(tuple(p), max_tokens)] = o.token_ids
    return [memo[(tuple(p), max_tokens)] for p in prompts]


# The speculative engines the lossless and prefix-cache tests share (name, K).
LOSSLESS_CASES = [("eagle3", 1), ("eagle3_orig", 3), ("eagle3", 7), ("peagle", 3), ("peagle", 7),
                  ("dflash4", 3), ("dflash8_zlab", 7), ("ngram", 3), ("draft_llama", 3)]


def sample_trials(eng, prompt, n_trials: int, n_tokens: int) -> np.ndarray:
    """i32[n_trials, n_tokens]: the first output tokens of n_trials requests on `prompt`,
    sampled at temperature 1.

    Rounds of max_num_seqs requests: add them, step until each has n_tokens outputs, abort.
    """
    import jspec

    sp = jspec.SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    rows, r = [], 0
    while len(rows) < n_trials:
        n = min(eng.config.max_num_seqs, n_trials - len(rows))
        rids = [f"dist-{r}-{i}" for i in range(n)]
        r += 1
        for rid in rids:
            eng.add_request(rid, prompt, sp)
        got = {rid: [] for rid in rids}
        while any(len(v) < n_tokens for v in got.values()):
            for out in eng.step():
                got[out.request_id] = out.token_ids
        for rid in rids:
            eng.abort_request(rid)
            rows.append(got[rid][:n_tokens])
    assert not eng.has_unfinished_requests()
    return np.asarray(rows)


def chi2_pvalue(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's chi-squared p-value of `counts` against `expected` (bins under 5 merged), df."""
    from scipy import stats

    order = np.argsort(expected)
    small = expected[order] < 5
    # Merge the smallest bins into one until it (and every other bin) reaches 5.
    k = int(small.sum())
    while k < len(order) and expected[order[:k]].sum() < 5:
        k += 1
    obs = np.concatenate([[counts[order[:k]].sum()], counts[order[k:]]]) if k else counts
    exp = np.concatenate([[expected[order[:k]].sum()], expected[order[k:]]]) if k else expected
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(stats.chi2.sf(stat, df)), df
