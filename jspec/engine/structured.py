"""Structured outputs: llguidance grammars as token masks, plain decoding and speculation.

Host (plain Python + llguidance, which computes masks in Rust):
  - ``check_grammar``: a StructuredOutputsParams' grammar text, validated without a
    tokenizer (SamplingParams construction); ``GrammarCompiler`` (one per engine) compiles
    it against the engine's tokenizer once per (kind, spec) and hands each request a copy
    of the compiled matcher (``Sequence.grammar``).
  - ``advance``: after a step, the matcher consumes the tokens the step appended (accepted
    drafts + the bonus token) and nothing else, so no state is rolled back; a grammar that
    is complete ends the request ("stop"); the next drafts are cut to their longest
    grammar-valid prefix (``validate_tokens``, vLLM's rule), so only those are verified.
  - ``build_bitmask``: the packed mask i32[B, Q, ceil(V/32)] of a step, position j of a
    verification row being the grammar state after d_1..d_j (llguidance's parallel
    executor walks the drafts and rolls them back); rows without a grammar allow everything.
Device: ``apply_bitmask`` sets the disallowed logits to -inf before the processors and the
rejection sampler, at every verification position: the sampler sees the masked target
distribution, and greedy speculative output equals greedy plain output.

A step whose batch has a grammar depends on the tokens of the step before it, which the
host knows only once it has read them: with async scheduling its call is split (the
engine's ``_chain``): the target's forward is dispatched behind the step before, and the
masks (``build_bitmask``, from the host state once that step is read), sampling and the
drafter follow in a second call. It runs one decode step per call for the same reason.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import threading

import jax.numpy as jnp
import numpy as np

from jspec.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger("jspec.engine")

_PARAM = "structured_outputs"
CACHE_SIZE = 256  # compiled grammars kept per engine (LRU)


# ---- grammars -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def grammar_text(key: tuple[str, str, bool]) -> str:
    """The llguidance grammar of a StructuredOutputsParams.key; SamplingParamsError naming
    the problem when it is invalid (checked without a tokenizer)."""
    import llguidance

    kind, spec, flexible = key
    try:
        if kind == "json":
            g = llguidance.LLMatcher.grammar_from_json_schema(
                _closed_objects(json.loads(spec)), defaults={"whitespace_flexible": flexible},
                overrides={"whitespace_pattern": WHITESPACE} if flexible else None)
        elif kind == "choice":
            g = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec)))
        elif kind == "regex":
            g = llguidance.LLMatcher.grammar_from_regex(spec)
        else:  # Lark (llguidance's syntax) or GBNF
            g = llguidance.grammar_from("grammar", spec)
    except ValueError as e:
        raise SamplingParamsError(_PARAM, f"{kind} is invalid: {e}") from None
    is_error, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(g)
    if is_error:
        raise SamplingParamsError(_PARAM, f"{kind} is invalid: {msgs[0].strip()}")
    return g


# JSON's whitespace between tokens, bounded: a space or two, or a newline and an indent of at
# most 16. llguidance's default ([ \t\n\r]+ at every gap) let a model write whitespace until
# max_tokens ran out (the family: '{\n' and 64 spaces); xgrammar bounds it the same way.
WHITESPACE = r"[\x20\x09]{0,2}|\x0A[\x20\x09]{0,16}"


def _closed_objects(schema):
    """The schema with ``additionalProperties: false`` on every object that lists its
    properties and says nothing of others: vLLM's default backend (xgrammar, strict mode)
    reads schemas so; open objects let a model add keys until max_tokens."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUBSCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: _closed_objects(v) for name, v in out[k].items()}
    for k in _SUBSCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [_closed_objects(v) for v in out[k]]
    for k in _SUBSCHEMAS:
        if k in out:
            out[k] = _closed_objects(out[k])
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def check_grammar(key) -> None:
    grammar_text(key)


class GrammarCompiler:
    """Compiled grammars of one engine: llguidance's tokenizer (built on first use from the
    engine's Hugging Face tokenizer, over the model's vocabulary, EOS = the engine's), and an
    LRU of compiled matchers by grammar key; each request gets a copy."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos = sorted(eos_token_ids)
        self._ll = None
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()  # the server validates on its event loop, steps on the engine thread
        self.num_compiled = 0
        self._closers = None

    def _ll_tokenizer(self):
        if self._ll is None:
            import llguidance.hf

            if self.tokenizer is None:
                raise SamplingParamsError(_PARAM, "needs a tokenizer, and the model folder has none")
            try:
                self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                        eos_token=self.eos or None)
            except ValueError as e:
                raise SamplingParamsError(_PARAM, f"cannot use this model's tokenizer: {e}") from None
        return self._ll

    def compiled(self, params: SamplingParams):
        """The compiled matcher of ``params.structured_outputs`` (cached), in its start state."""
        import llguidance

        key = params.structured_outputs.key
        with self._lock:
            m = self._cache.get(key)
            if m is not None:
                self._cache.move_to_end(key)
                return m
            m = llguidance.LLMatcher(self._ll_tokenizer(), grammar_text(key), log_level=0)
            if m.is_error():
                raise SamplingParamsError(_PARAM, f"{key[0]} is invalid: {m.get_error()}")
            self.num_compiled += 1
            self._cache[key] = m
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return m

    def check(self, params: SamplingParams) -> None:
        """SamplingParamsError when the request's grammar does not compile for this model."""
        if params.structured_outputs is not None:
            self.compiled(params)

    def matcher(self, params: SamplingParams):
        """A fresh matcher for one request (None without structured outputs)."""
        if params.structured_outputs is None:
            return None
        m = self.compiled(params)
        with self._lock:
            return m.deep_copy()

    def closers(self) -> tuple[int, ...]:
        """The tokens a closing path (``closing_path``) is made of, in order of preference:
        the EOS tokens, then the single-character tokens of CLOSING_CHARS this vocabulary has."""
        if self._closers is None:
            ll = self._ll_tokenizer()
            single = [t[0] for c in CLOSING_CHARS if len(t := ll.tokenize_str(c)) == 1]
            self._closers = tuple(self.eos) + tuple(dict.fromkeys(single))
        return self._closers


def any_grammar(rows) -> bool:
    """Does a row of this batch (ScheduledSeqs) have a grammar?"""
    return any(r.seq.grammar is not None for r in rows)


# ---- host: after a step -------------------------------------------------------------------
def advance(seq, new: list[int]) -> list[int]:
    """The grammar consumes the tokens a step appended to ``seq`` (``new``, its accepted
    drafts and bonus token). Ends the request with "stop" when the grammar is complete
    (tokens after the completing one are taken back), and cuts the next drafts to their
    longest grammar-valid prefix. Returns ``new`` as kept."""
    m = seq.grammar
    if m is None:
        return new
    for i, t in enumerate(new):
        if m.is_stopped():  # complete before t: t (the bonus after a completing draft) is dropped
            del seq.output_token_ids[len(seq.output_token_ids) - (len(new) - i):]
            new = new[:i]
            seq.finish_reason, seq.stop_reason, seq.stop_text = "stop", None, None
            break
        if not m.consume_token(t):  # the mask makes this unreachable
            logger.error("request %s: token %d breaks its grammar: %s", seq.request_id, t,
                         m.get_error().splitlines()[0])
            seq.finish_reason = "abort"
            return new
    if m.is_stopped() and seq.finish_reason in (None, "length"):
        # complete: "stop", also on the last token max_tokens allows (as EOS there is)
        seq.finish_reason, seq.stop_reason = "stop", None
    if seq.draft_token_ids and seq.finish_reason is None:
        n = m.validate_tokens(seq.draft_token_ids)
        del seq.draft_token_ids[n:]
    return new


# ---- host: closing within max_tokens ------------------------------------------------------
# A request with a grammar and max_tokens ends with output its grammar accepts: once the
# tokens it has left are no more than a short completion needs, each sampled token is that
# completion's next one (the mask allows it alone). Without this a model that rambles (a
# string that never closes, keys after keys) ran out of tokens with invalid JSON.
# Characters a closing path is written in, most preferred first: close a string or a
# container, the shortest values, separators, then letters for patterns.
CLOSING_CHARS = '"}])0,1n' + "tf{[:23456789.-_ " + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
CLOSING_HORIZON = 64  # paths are looked for only this close to max_tokens: the host's cost per step


def closing_path(m, closers: tuple[int, ...], limit: int) -> list[int] | None:
    """A short token sequence that completes matcher ``m``'s grammar (its last token leaves
    it stopped), found greedily: forced tokens, else the first of ``closers`` the grammar
    takes; None when none is found within ``limit`` tokens. ``m`` is not changed.

    Deterministic in m's state, so the path from the state after its first token is the
    rest of it: a request that follows it ends exactly when the path does."""
    m = m.deep_copy()
    path: list[int] = []
    while not m.is_stopped():
        if len(path) >= limit:
            return None
        forced = m.compute_ff_tokens()
        if forced:
            t = forced[0]
        else:
            t = next((c for c in closers if m.validate_tokens([c]) == 1), None)
            if t is None:
                return None
        if not m.consume_token(t):
            return None
        path.append(t)
        if m.is_accepting() and not m.is_stopped() and closers and m.validate_tokens([closers[0]]) == 1:
            path.append(closers[0])  # complete: EOS ends it (closers start with the EOS tokens)
            break
    return path


def _forced_token(seq, m, drafts: list[int]) -> int | None:
    """The token position len(drafts) of this row's step must take so that the output is
    complete within max_tokens (``closing_path``), or None when the row is free."""
    left = seq.params.max_tokens - len(seq.output_token_ids) - len(drafts) if seq.params.max_tokens else None
    if left is None or left > CLOSING_HORIZON or not seq.grammar_closers:
        return None
    if drafts:
        m = m.deep_copy()
        if not m.consume_tokens(drafts):
            return None
    path = closing_path(m, seq.grammar_closers, left)
    return path[0] if path and len(path) >= left else None


# ---- host: a step's masks -----------------------------------------------------------------
def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


_executor = None


def _get_executor():
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    return _executor


def build_bitmask(rows, B: int, Q: int, vocab_size: int, chained: bool = False) -> np.ndarray | None:
    """The packed masks i32[B, Q, ceil(V/32)] of a step (bit v % 32 of word v // 32: token v
    allowed), or None when no row has a grammar. Q = 1 (prefill, plain decode) or K + 1
    (verification: position j after the row's drafts d_1..d_j, which ``advance`` left
    grammar-valid). Rows without a grammar, positions past a row's drafts and rows that do
    not sample allow every token."""
    if not any_grammar(rows):
        return None
    if chained:  # a chained step's forward goes alone; its masks come with its tail (build_sample_input)
        raise RuntimeError("a step with structured outputs cannot be chained: its masks need the tokens before it")
    import llguidance.numpy

    mask = np.full((B * Q, bitmask_words(vocab_size)), -1, np.int32)
    work = [(r.seq.grammar, b * Q, list(r.seq.draft_token_ids[: Q - 1]))
            for b, r in enumerate(rows) if r.seq.grammar is not None and r.sample]
    if plain := [(m, i) for m, i, d in work if not d]:
        llguidance.numpy.fill_next_token_bitmask_par(_get_executor(), plain, mask)
    if drafted := [w for w in work if w[2]]:
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(_get_executor(), drafted, mask)
    for b, r in enumerate(rows):  # rows near max_tokens: the closing path's token alone
        if r.seq.grammar is not None and r.sample:
            drafts = list(r.seq.draft_token_ids[: Q - 1])
            for j in range(len(drafts) + 1):
                if (t := _forced_token(r.seq, r.seq.grammar, drafts[:j])) is not None:
                    mask[b * Q + j] = 0
                    mask[b * Q + j, t // 32] = np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return mask.reshape(B, Q, -1)


# ---- device -------------------------------------------------------------------------------
def apply_bitmask(logits, mask):
    """logits f32[B, Q, V] with the tokens ``mask`` (i32[B, Q, ceil(V/32)], None: no-op)
    disallows at -inf."""
    if mask is None:
        return logits
    V = logits.shape[-1]
    v = jnp.arange(V, dtype=jnp.int32)
    words = jnp.take(mask, v // 32, axis=-1)  # i32[B, Q, V]
    allowed = (jnp.right_shift(words, v % 32) & 1) == 1
    return jnp.where(allowed, logits, jnp.asarray(-jnp.inf, logits.dtype))
