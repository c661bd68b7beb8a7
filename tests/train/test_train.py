"""jspec.train: corpus, tokenizer, target and drafter training, formats and parity.

One tiny family (tokenizer, target, the target's greedy rows, EAGLE3, PEagle, DFlash) is
trained once per session through the CLI on the first stdlib files, saved in float32, then
checked: losses fall, the target loads in transformers and jspec with equal logits, the
generated rows are transformers' greedy continuations, each drafter loads in jspec and in
speculators' PyTorch module, the training forwards equal speculators' inference maths at
the positions each recipe scores (so what is trained is what is served), and greedy
speculative decoding equals greedy plain decoding.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jspec.checkpoint.target import load_target
from jspec.train import corpus as corpus_mod
from jspec.train import dflash, eagle3, tokenizer
from jspec.train import target as tgt
from jspec.train.pipeline import STAGES
from tests.helpers.drafters import ref_dflash, ref_eagle3, rel, speculators_from_folder

SEQ, MASK = 64, 5
CLI = ["--preset", "tiny", "--max-files", "30", "--seq-len", str(SEQ), "--batch-size", "8", "--steps", "100",
       "--drafter-steps", "20", "--warmup-steps", "10", "--lr", "3e-3", "--drafter-lr", "3e-3", "--log-every", "1000",
       "--eval-batches", "1", "--dflash-anchors", "16", "--save-dtype", "float32", "--generate-rows", "24",
       "--generate-prompt-max", "32", "--generate-batch", "8"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    from jspec.train.__main__ import main

    out = str(tmp_path_factory.mktemp("family"))
    main(["--stage", "all", "--out", out, *CLI])
    return out


def _log(family, stage):
    with open(os.path.join(family, stage, "train_log.json")) as f:
        return json.load(f)


# -- corpus and tokenizer ---------------------------------------------------------------


def test_corpus_files_split_and_manifest():
    c = corpus_mod.stdlib_corpus()
    assert list(c.files) == sorted(c.files) and len(c.files) > 300
    assert not any(set(f.split("/")[:-1]) & corpus_mod.EXCLUDED_DIRS for f in c.files)
    assert all(f.endswith(".py") for f in c.files)
    train, held = set(c.train_files), set(c.held_out_files)
    assert not train & held and train | held == set(c.files)
    assert 0.01 < len(held) / len(c.files) < 0.12
    # The split is a property of the path, not of the list: a subset splits the same way.
    sub = corpus_mod.stdlib_corpus(max_files=100)
    assert set(sub.held_out_files) == held & set(sub.files)
    m = c.manifest()
    assert m["files_sha256"] == c.files_hash() != sub.files_hash() and m["num_files"] == len(c.files)
    assert m["python_version"].count(".") == 2 and m["held_out_files"] == list(c.held_out_files)


def test_token_stream_pack_and_batches():
    s = corpus_mod.token_stream([[7, 8], [9]], bos_id=0, eod_id=1)
    assert s.tolist() == [0, 7, 8, 1, 0, 9, 1]
    rows = corpus_mod.pack(np.arange(23, dtype=np.int32), 5)
    assert rows.shape == (4, 5) and rows[-1].tolist() == [15, 16, 17, 18, 19]
    it = corpus_mod.batches(rows, 2, seed=0)
    epoch = np.concatenate([next(it), next(it)])
    assert sorted(epoch[:, 0].tolist()) == [0, 5, 10, 15]


def test_tokenizer_specials_roundtrip_and_chat_template(family):
    from transformers import AutoTokenizer

    from jspec.train.tokenizer import CHAT_TEMPLATE

    folder = os.path.join(family, "target")
    at = AutoTokenizer.from_pretrained(folder)
    assert [at.convert_tokens_to_ids(s) for s in tokenizer.ALL_SPECIAL_TOKENS] == list(range(6))
    assert (at.bos_token_id, at.pad_token_id, at.eos_token_id, at.mask_token_id) == (0, 1, 4, MASK)
    text = "def f(x):\n    return x ** 2  # é → ✓\n"
    ids = at.encode(text)
    assert ids[0] == 0 and at.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < len(text.encode())  # merges were learnt
    msgs = [{"role": "user", "content": "hi"}]
    assert at.chat_template == CHAT_TEMPLATE
    assert at.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    with open(os.path.join(folder, "corpus.json")) as f:
        manifest = json.load(f)
    assert manifest["num_files"] == 30 and manifest["vocab_size"] == 512 and len(manifest["files_sha256"]) == 64


# -- target ---------------------------------------------------------------------------


def test_target_loss_decreases(family):
    log = _log(family, "target")
    first, last = log["history"][0]["loss"], log["history"][-1]["loss"]
    assert last < first - 1.0, (first, last)
    assert log["held_out"]["loss"] < first - 1.0


def _jspec_logits(cfg, params, ids):
    """Logits of jspec's serving Transformer (paged KV cache) over one sequence."""
    from jspec.kv_cache import AttentionMetadata, KVCache
    from jspec.models.transformer import Transformer

    page, npages = 16, 8
    kv = KVCache.create(cfg.num_layers, npages, page, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    meta = AttentionMetadata.for_single_sequence(list(range(npages)), page, 0, len(ids), npages)
    m = Transformer(cfg)
    h, aux, _ = m.apply({"params": params}, jnp.asarray(ids[None]), meta, kv, aux_layers=(1, 2, 4))
    return np.asarray(m.apply({"params": params}, h, method=Transformer.logits)[0]), np.asarray(aux[0])


def test_target_loads_in_transformers_and_jspec_with_equal_logits(family):
    from transformers import LlamaForCausalLM

    folder = os.path.join(family, "target")
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = np.random.RandomState(0).randint(6, 512, size=40)
    with torch.no_grad():
        out = hf(torch.tensor(ids[None]), output_hidden_states=True)
    want = out.logits[0].numpy()
    cfg, params = load_target(folder, "float32")
    got, aux = _jspec_logits(cfg, params, ids)
    assert rel(got, want) < 1e-4
    # The training forward: same logits, and the canonical aux states drafters train on.
    h, taux = tgt.forward(params, cfg, jnp.asarray(ids[None]), (1, 2, 4))
    assert rel(np.asarray(tgt.logits(params, cfg, h)[0]), want) < 1e-4
    assert rel(np.asarray(taux[0]), aux) < 1e-5
    assert rel(np.asarray(taux[0, :, 0]), out.hidden_states[1][0].numpy()) < 1e-5


def test_bfloat16_compute_loss_close_to_float32(family):
    cfg, params = load_target(os.path.join(family, "target"), "float32")
    rows = np.random.RandomState(1).randint(6, 512, size=(2, SEQ)).astype(np.int32)
    l32, _ = tgt.lm_loss(params, None, jnp.asarray(rows), None, cfg=cfg)
    l16, _ = tgt.lm_loss(params, None, jnp.asarray(rows), None, cfg=cfg, dtype=jnp.bfloat16)
    assert abs(float(l16) - float(l32)) < 0.02 * float(l32)


# -- the drafters' rows ----------------------------------------------------------------


def test_generated_rows_are_prompts_then_the_targets_greedy_continuation(family):
    from transformers import LlamaForCausalLM

    from jspec.train.__main__ import parse_args
    from jspec.train.generate import prompts_from_stream

    rc = parse_args(["--out", family, *CLI])[0]
    rows = np.load(os.path.join(family, "generated", "tokens.npy"))
    bos = tokenizer.special_ids(tokenizer.load_tokenizer(os.path.join(family, "target")))[tokenizer.BOS]
    prompts = prompts_from_stream(np.load(os.path.join(family, "tokenizer", "tokens_train.npy")), bos, rc.generate)
    assert rows.shape == (24, SEQ) and len(prompts) == 24
    assert sum(p[0] == bos for p in prompts[::2]) == 12  # even rows: document starts
    assert all(8 <= len(p) <= 32 and rows[i, : len(p)].tolist() == p for i, p in enumerate(prompts))
    hf = LlamaForCausalLM.from_pretrained(os.path.join(family, "target"), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor(rows, dtype=torch.long)).logits.numpy()
    checked = 0
    for i, p in enumerate(prompts):
        for t in range(len(p) - 1, SEQ - 1):  # each generated token: the argmax after the row's prefix
            top2 = np.sort(logits[i, t])[-2:]
            if top2[1] - top2[0] > 1e-4:  # not a near-tie, where float32 sums may order either way
                assert rows[i, t + 1] == logits[i, t].argmax(), (i, t)
                checked += 1
    assert checked > 0.9 * sum(SEQ - len(p) for p in prompts)


def test_drafters_need_the_generated_rows_or_say_corpus(tmp_path):
    from jspec.train import pipeline

    with pytest.raises(FileNotFoundError, match="--stage generate"):
        pipeline._drafter_rows(pipeline.RunConfig(out=str(tmp_path)))
    with pytest.raises(ValueError, match="drafter_data"):
        pipeline.RunConfig(out=str(tmp_path), drafter_data="corpora")


def test_a_given_tokenizer_encodes_the_same_streams(family, tmp_path):
    from jspec.train.__main__ import main

    main(["--stage", "tokenizer", "--out", str(tmp_path), "--tokenizer-from", os.path.join(family, "target"), *CLI])
    for split in ("train", "held_out"):
        a, b = (np.load(os.path.join(f, "tokenizer", f"tokens_{split}.npy")) for f in (family, str(tmp_path)))
        assert np.array_equal(a, b), split


# -- drafters -------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["eagle3", "peagle", "dflash"])
def test_drafter_loss_decreases(family, method):
    log = _log(family, method)
    first, last = log["history"][0]["loss"], log["history"][-1]["loss"]
    assert last < 0.7 * first, (first, last)


@pytest.fixture(scope="module")
def loaded(family):
    from jspec.drafters import load_drafter

    tfolder = os.path.join(family, "target")
    tc, tp = load_target(tfolder, "float32")
    rows = corpus_mod.pack(np.load(os.path.join(family, "tokenizer", "tokens_held_out.npy")), SEQ)[:1]
    out = {}
    for m in ("eagle3", "peagle", "dflash"):
        dc, dp = load_drafter(os.path.join(family, m), tc)
        out[m] = (dc, dp, speculators_from_folder(os.path.join(family, m), tfolder))
    return tc, tp, rows, out


def test_drafter_configs_round_trip(loaded):
    d = loaded[3]
    e, p, f = d["eagle3"][0], d["peagle"][0], d["dflash"][0]
    assert (e.method, e.num_speculative_tokens, e.norm_before_residual) == ("eagle3", 3, True)
    assert not e.has_own_embeddings
    assert (p.method, p.num_speculative_tokens, p.mask_token_id, p.has_own_embeddings) == ("peagle", 5, MASK, True)
    assert (f.method, f.block_size, f.mask_token_id, f.uses_target_lm_head) == ("dflash", 8, MASK, True)
    assert e.aux_layer_ids == p.aux_layer_ids == f.aux_layer_ids == (1, 2, 3)
    assert not any(c.has_d2t for c in (e, p, f))


def test_eagle3_training_time_test_equals_stepwise_speculators(loaded):
    """Step k of the unroll at row i is the (k+1)-th draft after pairs 0..i, drafted with the
    corpus tokens fed in and each step's pre-norm output fed back."""
    tc, tp, rows, d = loaded
    dc, dp, model = d["eagle3"]
    steps, _ = eagle3.ttt_logits(dp, tp, jnp.asarray(rows), dc=dc, tc=tc, ttt_steps=3)
    _, aux = tgt.forward(tp, tc, jnp.asarray(rows), dc.aux_layer_ids)
    aux = np.asarray(aux[0]).reshape(SEQ, -1)
    x = rows[0]
    H = tc.hidden_size
    for i in (0, 9, 30):
        ids, fc_rows = list(x[1 : i + 2]), list(aux[: i + 1])
        direct, is_direct = [np.zeros(H)] * (i + 1), [False] * (i + 1)
        for k in range(3):
            lg, pre = ref_eagle3(model, np.array(ids), (np.array(fc_rows), np.array(direct), np.array(is_direct)),
                                 np.arange(len(ids)))
            assert rel(np.asarray(steps[k][0, i]), lg[-1]) < 1e-4, (i, k)
            ids.append(x[i + 2 + k])
            fc_rows.append(np.zeros_like(aux[0]))
            direct.append(pre[-1])
            is_direct.append(True)


def test_peagle_cod_forward_equals_parallel_speculators(loaded):
    """A depth-d element of anchor a is mask slot d of the forward over
    [pairs 0..a, MASK x d] that PEagle runs at inference."""
    tc, tp, rows, d = loaded
    dc, dp, model = d["peagle"]
    counts = eagle3.cod_counts(SEQ - 1, 5, 0.7, 0.2)
    anchor, depth = eagle3.cod_layout(jax.random.key(3), 1, counts)
    lg, _ = eagle3.peagle_logits(dp, tp, jnp.asarray(rows), anchor, depth, dc=dc, tc=tc)
    _, aux = tgt.forward(tp, tc, jnp.asarray(rows), dc.aux_layer_ids)
    aux = np.asarray(aux[0]).reshape(SEQ, -1)
    x, anchor = rows[0], np.asarray(anchor[0])
    starts = np.cumsum([0] + counts)
    for dd in range(5):
        e = starts[dd] + (counts[dd] // 2)  # one element of each depth
        a = int(anchor[e])
        ids = np.concatenate([x[1 : a + 2], np.full(dd, MASK, x.dtype)])
        fc_rows = np.concatenate([aux[: a + 1], np.zeros((dd, aux.shape[1]))])
        slots = np.arange(a + 1 + dd) > a
        want, _ = ref_eagle3(model, ids, (fc_rows, None, np.zeros(len(ids), bool)), np.arange(len(ids)),
                             mask_slots=slots)
        assert rel(np.asarray(lg[0, e]), want[-1]) < 1e-4, (dd, a)


def test_dflash_blocks_equal_speculators(loaded):
    tc, tp, rows, d = loaded
    dc, dp, model = d["dflash"]
    bs = dc.block_size
    anchors = np.array([[3, 20, 56]], np.int32)
    lg, _ = dflash.dflash_logits(dp, tp, jnp.asarray(rows), jnp.asarray(anchors), dc=dc, tc=tc)
    _, aux = tgt.forward(tp, tc, jnp.asarray(rows), dc.aux_layer_ids)
    aux = np.asarray(aux[0]).reshape(SEQ, -1)
    for j, a in enumerate(anchors[0]):
        block = np.array([rows[0, a]] + [MASK] * (bs - 1))
        want = ref_dflash(model, aux[:a], np.arange(a), block, np.arange(a, a + bs))
        assert rel(np.asarray(lg[0, j * bs : (j + 1) * bs]), want) < 1e-4, a


def test_speculative_greedy_equals_plain_on_the_trained_family(family):
    import jspec

    c = corpus_mod.stdlib_corpus(max_files=30)
    prompts = [c.read(f)[:80] for f in c.held_out_files[:2]]
    sp = jspec.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    # Few compiled shapes: batch bucket 1, prefill chunks {16, 32}.
    kw = dict(max_num_seqs=1, max_model_len=96, page_size=16, max_prefill_chunk=32, max_num_batched_tokens=64)
    tfolder = os.path.join(family, "target")
    ref = [o.token_ids for o in jspec.LLM(tfolder, **kw).generate(prompts, sp)]
    for m in ("eagle3", "peagle", "dflash"):
        llm = jspec.LLM(tfolder, speculative_config={"method": m, "model": os.path.join(family, m)}, **kw)
        assert [o.token_ids for o in llm.generate(prompts, sp)] == ref, m
        assert llm.engine.stats()["num_drafts"] > 0


def test_cli_stages_and_sizes():
    from jspec.train.__main__ import parse_args

    rc, stages = parse_args(["--stage", "target,drafters", "--out", "x", "--hidden-size", "96", "--peagle-k", "4",
                             "--dflash-block-size", "16"])
    assert stages == ["target", "eagle3", "peagle", "dflash"]
    assert rc.drafter_data == "generated" and rc.tokenizer_from is None
    assert rc.target.hidden_size == 96 and rc.target.vocab_size == 8192
    assert rc.drafter_size("peagle").num_speculative_tokens == 4
    assert rc.drafter_size("dflash").block_size == 16 and rc.drafter_size("dflash").num_speculative_tokens == 15
    assert parse_args(["--stage", "all,accept", "--out", "x"])[1] == [*STAGES, "accept"]
    with pytest.raises(SystemExit):
        parse_args(["--stage", "nope", "--out", "x"])
    rc = parse_args(["--out", "x", "--drafter-data", "corpus", "--generate-rows", "64", "--generate-prompt-max", "40",
                     "--tokenizer-from", "tok"])[0]
    assert (rc.drafter_data, rc.generate.rows, rc.generate.prompt_max, rc.tokenizer_from) == ("corpus", 64, 40, "tok")
    assert parse_args(["--out", "x", "--dflash-k", "3"])[0].drafter_size("dflash").num_speculative_tokens == 3


def test_acceptance_prompts_are_long_enough_held_out_document_starts():
    from jspec.train.acceptance import held_out_prompts

    stream = np.array([0, 7, 8, 1, 0, 9, 9, 9, 9, 1, 0, 5, 5, 5, 5, 5, 1], np.int32)
    assert held_out_prompts(stream, 0, n=5, prompt_tokens=2, max_tokens=3) == [[0, 9], [0, 5]]
    assert held_out_prompts(stream, 0, n=1, prompt_tokens=2, max_tokens=3) == [[0, 9]]
