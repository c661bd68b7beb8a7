"""Shared pieces of the SamplingParams tests (issue 26): the speculative tests' tiny target
(tests/helpers/spec_e2e.py, vocab 64) with a word-level tokenizer ("w0".."w63", so ``bad_words`` and
``stop`` strings have tokens to name), engines over it per drafter, and an independent
reference: vLLM's logits processors written out in numpy over transformers' logits."""

from __future__ import annotations

import shutil
from collections import Counter

import numpy as np
import torch

import jspec
from tests.helpers import spec_e2e as h

EOS = 2  # the target's eos_token_id
# (drafter, K): every method; None is plain decoding.
ENGINES = [(None, None), ("eagle3", 3), ("peagle", 3), ("dflash4", 3)]
_CACHE: dict = {}


def target_folder() -> str:
    """A copy of the spec target's folder with a word-level tokenizer: token i is "wi"."""
    if "folder" not in _CACHE:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        src, _ = h.target()
        dst = src + "_tok"
        shutil.copytree(src, dst, dirs_exist_ok=True)
        tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(h.V)}, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(dst)
        _CACHE["folder"] = dst
    return _CACHE["folder"]


def engine(name: str | None, k: int | None, **kw) -> jspec.LLM:
    """A jspec.LLM over the tokenized target (and drafter ``name``), cached per configuration."""
    key = (name, k, tuple(sorted(kw.items())))
    if key not in _CACHE:
        sc = None if name is None else h.spec_config(name, k)
        _CACHE[key] = jspec.LLM(target_folder(), speculative_config=sc, **{**h.ENGINE_KW, **kw})
    return _CACHE[key]


def hf_logits(ids: list[int]) -> np.ndarray:
    """f32[len(ids), V]: transformers' logits at every position."""
    _, model = h.target()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def bad_word_ids(words) -> list[list[int]]:
    return [[int(w[1:]) for w in word.split()] for word in words or ()]


def processed(logits: np.ndarray, prompt: list[int], out: list[int], sp) -> np.ndarray:
    """vLLM's processors on one row of logits (f32[V]) given the prompt and the output so
    far, in its order: allowed_token_ids, bad_words (over the output), min_tokens (EOS and
    stop_token_ids), logit_bias, repetition / frequency / presence penalties."""
    x = logits.astype(np.float32).copy()
    V = x.shape[0]
    if sp.allowed_token_ids is not None:
        keep = np.zeros(V, bool)
        keep[list(sp.allowed_token_ids)] = True
        x[~keep] = -np.inf
    for w in bad_word_ids(sp.bad_words):
        n = len(w) - 1
        if n == 0 or (len(out) >= n and out[len(out) - n:] == w[:-1]):
            x[w[-1]] = -np.inf
    if len(out) < sp.min_tokens:
        for t in set(sp.stop_token_ids or ()) | {EOS}:
            x[t] = -np.inf
    for t, b in (sp.logit_bias or {}).items():
        x[t] = x[t] + np.float32(b)
    r = np.float32(sp.repetition_penalty)
    for t in set(prompt) | set(out):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, c in Counter(out).items():
        x[t] = x[t] - np.float32(sp.frequency_penalty) * np.float32(c) - np.float32(sp.presence_penalty)
    return x


def reference_greedy(prompt: list[int], sp) -> list[int]:
    """Greedy decoding with the processors applied to transformers' logits, stopping as
    vLLM does (EOS unless ignore_eos, stop_token_ids; not before min_tokens)."""
    out: list[int] = []
    while len(out) < sp.max_tokens:
        x = processed(hf_logits(prompt + out)[-1], prompt, out, sp)
        t = int(np.argmax(x))
        out.append(t)
        if len(out) > sp.min_tokens and ((not sp.ignore_eos and t == EOS) or t in (sp.stop_token_ids or ())):
            break
    return out
