"""The stages of ``python -m jspec.train``, each reading the previous stage's folder.

  OUT/tokenizer/  tokenizer.json, tokenizer_config.json, corpus.json (the manifest),
                  tokens_train.npy, tokens_held_out.npy (the encoded corpus streams)
  OUT/target/     config.json, generation_config.json, model.safetensors, the tokenizer
                  files, corpus.json, train_log.json: a HF Llama folder
  OUT/generated/  tokens.npy (rows of prompt + the target's greedy continuation: the
                  drafters' training rows), generate_log.json (generate.py)
  OUT/{eagle3,peagle,dflash}/  config.json (speculators format), model.safetensors,
                  train_log.json
  OUT/acceptance.json  the "accept" stage: greedy acceptance on held-out files (acceptance.py)

Every stage is deterministic given the RunConfig (seed included) and the Python version
(the corpus); train_log.json records the settings, the losses and held-out metrics.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.checkpoint.target import load_target
from jspec.config import model_config_from_hf
from jspec.drafters.loader import load_drafter, read_drafter_config
from jspec.train import corpus as corpus_mod
from jspec.train import dflash, drafters, eagle3, generate, loop, target, tokenizer

STAGES = ("tokenizer", "target", "generate", "eagle3", "peagle", "dflash")  # "all"; "accept" is asked for by name
DRAFTER_DATA = ("generated", "corpus")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    out: str
    target: target.TargetSize = target.PRESETS["small"]
    drafter_sizes: tuple[drafters.DrafterSize, ...] = tuple(drafters.DEFAULTS.values())
    max_files: int | None = None  # None: the whole stdlib
    seq_len: int = 512
    batch_size: int = 32
    steps: int = 800  # target: ~5.5 epochs of the 2.4M-token corpus; 4000 memorised it (held-out loss 6.66 vs 3.31)
    drafter_steps: int = 4000
    lr: float = 2e-3
    drafter_lr: float = 1e-3
    warmup_steps: int = 200
    dtype: str = "float32"  # compute dtype ("bfloat16" on accelerators); master weights stay f32
    save_dtype: str = "bfloat16"
    seed: int = 0
    log_every: int = 100
    eval_batches: int = 8  # held-out batches scored after each stage
    ttt_steps: int = 3  # EAGLE3
    ttt_decay: float = 0.8
    peagle_ratio: float = 0.7
    peagle_ratio_min: float = 0.2
    dflash_anchors: int = 64
    dflash_gamma: float = 4.0
    accept_prompts: int = 32  # "accept": held-out prompts, their length and the tokens generated
    accept_prompt_tokens: int = 128
    accept_max_tokens: int = 128
    # The drafters' rows: "generated" (the target's greedy continuations, the generate stage)
    # or "corpus" (the target's training rows); the generate stage's settings.
    drafter_data: str = "generated"
    generate: generate.GenerateConfig = generate.GenerateConfig()
    # A tokenizer folder to encode the corpus with instead of training one (new drafters for
    # a target already trained, e.g. jspec/family/jspec-stdlib-10m): same ids, same streams.
    tokenizer_from: str | None = None
    # A trained drafter folder to start from instead of random weights (a second phase: the
    # shipped DFlash is the corpus-trained one fine-tuned on generated rows, docs/training.md).
    drafter_init: str | None = None

    def __post_init__(self):
        if self.drafter_data not in DRAFTER_DATA:
            raise ValueError(f"drafter_data must be one of {DRAFTER_DATA}, got {self.drafter_data!r}")

    def folder(self, stage: str) -> str:
        return os.path.join(self.out, stage)

    def drafter_size(self, method: str) -> drafters.DrafterSize:
        return next(s for s in self.drafter_sizes if s.method == method)


def _settings(rc: RunConfig) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(rc), default=str))


def _write_log(folder: str, rc: RunConfig, history, evaluation: dict, seconds: float, **extra):
    with open(os.path.join(folder, "train_log.json"), "w") as f:
        json.dump({"settings": _settings(rc), "seconds": seconds, "held_out": evaluation, "history": history,
                   "jax_backend": jax.default_backend(), **extra}, f, indent=1)


def stage_tokenizer(rc: RunConfig, log=print):
    """Train the BPE on the train split (or take ``rc.tokenizer_from``'s), encode both
    splits, write the manifest."""
    t0 = time.perf_counter()
    c = corpus_mod.stdlib_corpus(max_files=rc.max_files)
    texts = c.texts("train")
    if rc.tokenizer_from:
        tok = tokenizer.load_tokenizer(rc.tokenizer_from)
        if tok.get_vocab_size() != rc.target.vocab_size:
            raise ValueError(f"the tokenizer in {rc.tokenizer_from} has {tok.get_vocab_size()} tokens; the target's "
                             f"vocab_size is {rc.target.vocab_size}")
    else:
        tok = tokenizer.train_tokenizer(texts, rc.target.vocab_size)
    folder = rc.folder("tokenizer")
    tokenizer.save_tokenizer(tok, folder)
    ids = tokenizer.special_ids(tok)
    counts = {}
    for split, tx in (("train", texts), ("held_out", c.texts("held_out"))):
        stream = corpus_mod.token_stream(tokenizer.encode_docs(tok, tx), ids[tokenizer.BOS], ids[tokenizer.END_OF_TEXT])
        np.save(os.path.join(folder, f"tokens_{split}.npy"), stream)
        counts[split] = len(stream)
    corpus_mod.save_manifest(c, folder, vocab_size=tok.get_vocab_size(), tokens=counts)
    log(f"[tokenizer] {len(c.files)} files ({len(c.held_out_files)} held out), vocab {tok.get_vocab_size()}, "
        f"{counts['train']:,} train / {counts['held_out']:,} held-out tokens, {time.perf_counter() - t0:.1f}s")


def _stream(rc: RunConfig, split: str) -> np.ndarray:
    fn = os.path.join(rc.folder("tokenizer"), f"tokens_{split}.npy")
    if not os.path.exists(fn):
        raise FileNotFoundError(f"{fn} is missing: run the tokenizer stage first (--stage tokenizer)")
    return np.load(fn)


def _rows(rc: RunConfig, split: str) -> np.ndarray:
    return corpus_mod.pack(_stream(rc, split), rc.seq_len)


def _drafter_rows(rc: RunConfig) -> np.ndarray:
    """The drafters' training rows (``rc.drafter_data``)."""
    if rc.drafter_data == "corpus":
        return _rows(rc, "train")
    fn = os.path.join(rc.folder("generated"), "tokens.npy")
    if not os.path.exists(fn):
        raise FileNotFoundError(f"{fn} is missing: run the generate stage first (--stage generate), or train the "
                                f"drafters on corpus rows (--drafter-data corpus)")
    return np.load(fn)


def _eval_batches(rc: RunConfig, rows: np.ndarray):
    n = min(rc.eval_batches, len(rows) // rc.batch_size)
    if n == 0:  # a held-out split smaller than one batch: score what there is
        return [rows]
    return [rows[i * rc.batch_size : (i + 1) * rc.batch_size] for i in range(n)]


def stage_target(rc: RunConfig, log=print):
    tok_dir = rc.folder("tokenizer")
    ids = tokenizer.special_ids(tokenizer.load_tokenizer(tok_dir))
    hf = target.hf_config(rc.target, bos_id=ids[tokenizer.BOS],
                          eos_ids=[ids[tokenizer.END_OF_TEXT], ids[tokenizer.EOT]], dtype=rc.save_dtype)
    cfg = model_config_from_hf(hf)
    params = target.init_target(cfg, jax.random.key(rc.seed))
    log(f"[target] {target.num_params(params):,} parameters, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}")
    train, held = _rows(rc, "train"), _rows(rc, "held_out")
    fn = target.loss_fn(cfg, DTYPES[rc.dtype])
    oc = loop.OptConfig(steps=rc.steps, lr=rc.lr, warmup_steps=rc.warmup_steps)
    t0 = time.perf_counter()
    params, history = loop.fit(fn, params, None, corpus_mod.batches(train, rc.batch_size, rc.seed), oc, seed=rc.seed,
                               log_every=rc.log_every, log=log, name="target",
                               tokens_per_batch=rc.batch_size * rc.seq_len)
    seconds = time.perf_counter() - t0
    ev = loop.evaluate(fn, params, None, _eval_batches(rc, held))
    log(f"[target] held-out loss {ev['loss']:.4f} (ppl {np.exp(ev['loss']):.2f}), acc {ev['acc']:.4f}")
    folder = rc.folder("target")
    target.save_target(params, hf, folder, rc.save_dtype)
    for fn_ in os.listdir(tok_dir):
        if fn_.startswith("tokenizer") or fn_ in ("chat_template.jinja", "special_tokens_map.json", "corpus.json"):
            shutil.copy(os.path.join(tok_dir, fn_), folder)
    _write_log(folder, rc, history, ev, seconds, num_params=target.num_params(params))


def stage_generate(rc: RunConfig, log=print):
    """The target's greedy continuations of prompts from the train stream (generate.py)."""
    tdir = rc.folder("target")
    if not os.path.isdir(tdir):
        raise FileNotFoundError(f"{tdir} is missing: run the target stage first (--stage target)")
    gc = rc.generate
    bos = tokenizer.special_ids(tokenizer.load_tokenizer(tdir))[tokenizer.BOS]
    prompts = generate.prompts_from_stream(_stream(rc, "train"), bos, gc)
    folder = rc.folder("generated")
    os.makedirs(folder, exist_ok=True)
    fn = os.path.join(folder, "tokens.npy")
    t0 = time.perf_counter()
    rows = generate.continue_greedily(tdir, prompts, rc.seq_len, gc, log=log, save=lambda r: np.save(fn, r))
    seconds = time.perf_counter() - t0
    with open(os.path.join(folder, "generate_log.json"), "w") as f:
        json.dump({"settings": _settings(rc), "seconds": seconds, "rows": len(rows), "tokens": int(rows.size),
                   "prompt_tokens": int(sum(map(len, prompts))), "distinct_rows": len(np.unique(rows, axis=0)),
                   "jax_backend": jax.default_backend()}, f, indent=1)
    log(f"[generate] {len(rows)} rows of {rc.seq_len} tokens in {seconds:.0f}s "
        f"({rows.size / max(seconds, 1e-9):,.0f} tok/s)")


def drafter_loss(method: str, dc, tc, rc: RunConfig):
    dt = DTYPES[rc.dtype]
    if method == "eagle3":
        return eagle3.loss_fn(dc, tc, dt, ttt_steps=rc.ttt_steps, decay=rc.ttt_decay)
    if method == "peagle":
        return eagle3.loss_fn(dc, tc, dt, depths=rc.drafter_size("peagle").num_speculative_tokens,
                              ratio=rc.peagle_ratio, ratio_min=rc.peagle_ratio_min)
    return dflash.loss_fn(dc, tc, dt, num_anchors=rc.dflash_anchors, gamma=rc.dflash_gamma)


def stage_drafter(rc: RunConfig, method: str, log=print):
    tdir = rc.folder("target")
    # The target as served (saved dtype), widened to f32 for the frozen forward.
    tc, tparams = load_target(tdir, "float32")
    with open(os.path.join(tdir, "config.json")) as f:
        thf = json.load(f)
    ids = tokenizer.special_ids(tokenizer.load_tokenizer(tdir))
    if rc.drafter_init:
        d = read_drafter_config(rc.drafter_init)
        if d.get("speculators_model_type") != method:
            raise ValueError(f"--drafter-init {rc.drafter_init} holds a {d.get('speculators_model_type')!r} drafter, "
                             f"not {method!r}")
        d = {k: v for k, v in d.items() if k != "torch_dtype"}  # save_drafter writes the save dtype
        # This run's proposal default K (--eagle3-k, --peagle-k, --dflash-k) replaces the init's.
        d["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = \
            rc.drafter_size(method).num_speculative_tokens
        dc, params = load_drafter(rc.drafter_init, tc, "float32")
        dc = drafters.drafter_config(d, tc)
    else:
        d = drafters.speculators_config(rc.drafter_size(method), thf, mask_token_id=ids[tokenizer.MASK_TOKEN])
        dc = drafters.drafter_config(d, tc)
        params = drafters.init_drafter(dc, tparams, jax.random.key(rc.seed + 1))
    log(f"[{method}] {target.num_params(params):,} parameters, {dc.num_layers} layers, aux {list(dc.aux_layer_ids)}"
        + (f", from {rc.drafter_init}" if rc.drafter_init else ""))
    fn = drafter_loss(method, dc, tc, rc)
    train, held = _drafter_rows(rc), _rows(rc, "held_out")
    oc = loop.OptConfig(steps=rc.drafter_steps, lr=rc.drafter_lr, warmup_steps=rc.warmup_steps)
    t0 = time.perf_counter()
    params, history = loop.fit(fn, params, tparams, corpus_mod.batches(train, rc.batch_size, rc.seed + 1), oc,
                               seed=rc.seed + 1, log_every=rc.log_every, log=log, name=method,
                               tokens_per_batch=rc.batch_size * rc.seq_len)
    seconds = time.perf_counter() - t0
    ev = loop.evaluate(fn, params, tparams, _eval_batches(rc, held))
    log(f"[{method}] held-out " + " ".join(f"{k} {v:.4f}" for k, v in ev.items()))
    folder = rc.folder(method)
    drafters.save_drafter(params, d, dc, folder, rc.save_dtype)
    extra = {}
    if rc.drafter_data == "generated":  # the rows' own settings (this run's rc.generate may differ)
        with open(os.path.join(rc.folder("generated"), "generate_log.json")) as f:
            g = json.load(f)
        extra["generated_rows"] = {"generate": g["settings"]["generate"], "seq_len": g["settings"]["seq_len"],
                                   **{k: g[k] for k in ("rows", "tokens", "seconds", "jax_backend")}}
    _write_log(folder, rc, history, ev, seconds, num_params=target.num_params(params), **extra)


def run(rc: RunConfig, stages, log=print):
    for s in stages:
        if s == "tokenizer":
            stage_tokenizer(rc, log)
        elif s == "target":
            stage_target(rc, log)
        elif s == "generate":
            stage_generate(rc, log)
        elif s in ("eagle3", "peagle", "dflash"):
            stage_drafter(rc, s, log)
        elif s == "accept":
            from jspec.train import acceptance

            acceptance.measure(rc.out, num_prompts=rc.accept_prompts, prompt_tokens=rc.accept_prompt_tokens,
                               max_tokens=rc.accept_max_tokens, dtype=rc.save_dtype, log=log)
        else:
            raise ValueError(f"unknown stage {s!r} (choose from {STAGES}, 'accept' or 'all')")
