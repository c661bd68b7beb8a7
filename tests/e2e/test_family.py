"""The shipped model family (jspec.family) through the ordinary loaders: greedy speculation
equals plain decoding with each drafter, its acceptance on held-out standard-library files
is what the family was trained for, speculators' PyTorch modules load each shipped drafter
and give jspec's logits, and a method alone picks the family's drafter."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import jspec
from jspec import family
from jspec.checkpoint.target import load_target
from jspec.drafters import load_drafter
from jspec.train import acceptance, corpus, tokenizer
from tests.helpers.drafters import (
    dflash_block_logits,
    eagle3_first_pass,
    peagle_mask_slot_logits,
    ref_dflash,
    ref_eagle3,
    rel,
    speculators_from_folder,
    target_aux,
)

# The bars for greedy mean acceptance length on held-out files, DFlash over its whole
# block of 8 (K = 7; its shipped default drafts 4), PEagle at the K = 5 it was trained for
# (shipped: 3); the family measured 2.89 / 2.60 / 3.08 on these prompts, float32, Python
# 3.11's copies of the held-out files.
MIN_ACCEPTANCE = {"eagle3": 2.2, "peagle": 2.2, "dflash": 2.8}
BLOCK_K = {"dflash": 7, "peagle": 5}
T = 40  # tokens of context for the logits checks (the helpers' page pool holds 64)


@pytest.fixture(scope="module")
def held_out_prompts():
    """16 prompts of 128 tokens: starts of the held-out files the family never trained on,
    as this Python's standard library has them."""
    with open(os.path.join(family.TARGET, "corpus.json")) as f:
        files = json.load(f)["held_out_files"]
    root = corpus.stdlib_root()
    texts = []
    for rel_path in files:
        if os.path.exists(os.path.join(root, rel_path)):
            with open(os.path.join(root, rel_path), encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
    tok = tokenizer.load_tokenizer(family.TARGET)
    ids = tokenizer.special_ids(tok)
    stream = corpus.token_stream(tokenizer.encode_docs(tok, texts), ids[tokenizer.BOS], ids[tokenizer.END_OF_TEXT])
    prompts = acceptance.held_out_prompts(stream, ids[tokenizer.BOS], 16, 128, 96)
    assert len(prompts) == 16
    return prompts


def test_greedy_speculation_equals_plain_with_the_trained_acceptance(held_out_prompts):
    drafters = {m: os.path.join(family.ROOT, m) for m in family.METHODS}
    r = acceptance.measure_prompts(family.TARGET, drafters, held_out_prompts, max_tokens=96, max_num_seqs=8,
                                   num_speculative_tokens=BLOCK_K)
    for m in family.METHODS:
        assert r[m]["matches_plain"] == 1.0, m
        assert r[m]["mean_acceptance_length"] >= MIN_ACCEPTANCE[m], (m, r[m])


@pytest.fixture(scope="module")
def target(held_out_prompts):
    cfg, params = load_target(family.TARGET, "float32")
    return cfg, params, np.asarray(held_out_prompts[0][: T + 1])


def test_shipped_eagle3_logits_equal_speculators(target):
    tcfg, tparams, ids = target
    folder = os.path.join(family.ROOT, "eagle3")
    cfg, params = load_drafter(folder, tcfg)
    aux = target_aux(tcfg, tparams, ids[:T], cfg.aux_layer_ids)
    tokens = ids[1 : T + 1]  # token t+1 paired with target hidden t
    got, _ = eagle3_first_pass(cfg, params, tparams, tokens, aux)
    want, _ = ref_eagle3(speculators_from_folder(folder, family.TARGET), tokens, (aux, None, np.zeros(T, bool)),
                         np.arange(T))
    assert rel(got, want) < 1e-4


def test_shipped_peagle_logits_equal_speculators(target):
    tcfg, tparams, ids = target
    folder = os.path.join(family.ROOT, "peagle")
    cfg, params = load_drafter(folder, tcfg)
    K = cfg.num_speculative_tokens
    aux = target_aux(tcfg, tparams, ids[:T], cfg.aux_layer_ids)
    tokens = np.concatenate([ids[1 : T + 1], np.full(K - 1, cfg.mask_token_id)])
    rows = np.concatenate([aux, np.zeros((K - 1, aux.shape[1]), np.float32)])
    is_mask = np.arange(T + K - 1) >= T
    got = peagle_mask_slot_logits(cfg, params, tokens, rows, is_mask)
    want, _ = ref_eagle3(speculators_from_folder(folder, family.TARGET), tokens, (rows, None, None),
                         np.arange(T + K - 1), mask_slots=is_mask)
    assert rel(got, want) < 1e-4


def test_shipped_dflash_logits_equal_speculators(target):
    tcfg, tparams, ids = target
    folder = os.path.join(family.ROOT, "dflash")
    cfg, params = load_drafter(folder, tcfg)
    bs = cfg.block_size
    aux = target_aux(tcfg, tparams, ids[:T], cfg.aux_layer_ids)
    block_ids = [int(ids[T])] + [cfg.mask_token_id] * (bs - 1)
    got = dflash_block_logits(cfg, params, tparams, aux, int(ids[T]))
    want = ref_dflash(speculators_from_folder(folder, family.TARGET), aux, np.arange(T), block_ids,
                      np.arange(T, T + bs))
    assert rel(got, want) < 1e-4


def test_a_method_alone_takes_the_family_drafter_and_is_an_error_elsewhere(tmp_path):
    assert family.drafter_for(None, "eagle3") == os.path.join(family.ROOT, "eagle3")
    assert family.drafter_for(family.TARGET, "dflash") == os.path.join(family.ROOT, "dflash")
    with pytest.raises(ValueError, match="'model' is required|drafter checkpoint path is required"):
        family.drafter_for(str(tmp_path), "eagle3")
    llm = jspec.LLM(speculative_config={"method": "eagle3"}, dtype="float32", max_model_len=64, max_num_seqs=1)
    assert llm.engine.dcfg.method == "eagle3" and llm.engine.model_name == os.path.basename(family.TARGET)


@pytest.mark.parametrize("method", family.METHODS)
def test_sampled_tokens_follow_the_target_at_temperature_1(method):
    """Per position, the counts of the first two verified tokens over 1024 requests against
    the expectation from transformers' LlamaForCausalLM on the family's target (the chi-squared
    test of tests/e2e/test_spec_distribution.py); the same counts reject the T = 0.7 distribution."""
    import torch
    from transformers import LlamaForCausalLM

    from tests.helpers.spec_e2e import chi2_pvalue, sample_trials

    tok = tokenizer.load_tokenizer(family.TARGET)
    prompt = tok.encode("import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n").ids
    eng = jspec.LLM(speculative_config={"method": method}, dtype="float32", max_num_seqs=64, max_model_len=64,
                    max_num_batched_tokens=1024).engine
    toks = sample_trials(eng, prompt, 1024, 3)
    hf = LlamaForCausalLM.from_pretrained(family.TARGET, torch_dtype=torch.float32).eval()
    assert eng.stats()["num_accepted_tokens"] > 0
    for j in (1, 2):
        ctx, inverse = np.unique(toks[:, :j], axis=0, return_inverse=True)
        ids = torch.as_tensor(np.concatenate([np.tile(prompt, (len(ctx), 1)), ctx], 1))
        with torch.no_grad():
            logits = hf(ids).logits[:, -1].double()
        counts = np.bincount(toks[:, j], minlength=logits.shape[-1]).astype(np.float64)
        p, df = chi2_pvalue(counts, torch.softmax(logits, -1).numpy()[inverse.reshape(-1)].sum(0))
        p_wrong, _ = chi2_pvalue(counts, torch.softmax(logits / 0.7, -1).numpy()[inverse.reshape(-1)].sum(0))
        assert p > 1e-3, (method, j, p, df)
        assert p_wrong < 1e-6, (method, j, p_wrong)


def test_the_main_job_prints_its_report_with_ngram(capsys):
    """``python -m jspec --method ngram``: vLLM's prompt lookup on the family's target, no
    drafter; the report the README promises (acceptance, speedup, greedy equality)."""
    from jspec.__main__ import main

    main(["--method", "ngram", "--max-tokens", "24", "--rounds", "1", "a = [1, 2, 3]\na = [1, 2, 3]\na = [1,"])
    out = capsys.readouterr().out
    assert "speculative decoding, ngram K=3" in out
    assert "mean acceptance length: " in out and "speedup over plain decoding: " in out
    assert "greedy outputs equal to plain decoding: 1 of 1" in out
    length = float(out.split("mean acceptance length: ")[1].split()[0])
    assert length > 1.0  # the prompt repeats itself: the lookup finds it
