"""Per-request sampling parameters (vLLM's names and meanings).

Everything that can be checked without the model is checked here, so a bad request fails
before it reaches the scheduler; what needs the model (token ids in the vocabulary, the
logprobs limit, a tokenizer for ``stop`` / ``bad_words``) is checked by
``LLMEngine.validate``. Every error is a ValueError naming the field.

How each field acts (vLLM's order inside one sampling step, jspec/engine/logits_processing.py):
allowed_token_ids, bad_words, min_tokens (EOS and stop_token_ids masked), logit_bias, then
repetition / frequency / presence penalties; greedy takes the argmax there; sampled rows
apply temperature, min_p, top-k and top-p. Speculative verification applies the same
processors to the target's logits at every draft position, counting the drafts before it.
``structured_outputs`` (vLLM's StructuredOutputsParams) constrains the output to a JSON
schema, regex, choice or grammar: a token mask applied before all of them
(jspec/engine/structured.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math


class SamplingParamsError(ValueError):
    """A bad SamplingParams value; ``param`` names the field (the server's 400 carries it)."""

    def __init__(self, param: str, msg: str):
        super().__init__(f"SamplingParams: {param} {msg}")
        self.param = param


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one of ``json`` (a JSON schema, as a dict or its
    JSON text), ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (a
    Lark grammar in llguidance's syntax, or GBNF) or ``json_object`` (any JSON object).
    ``disable_any_whitespace``: JSON without whitespace between its tokens (vLLM's name).
    The grammar is checked here (without the tokenizer): a bad one is a SamplingParamsError
    naming ``structured_outputs`` and the grammar engine's message."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        def bad(msg):
            raise SamplingParamsError("structured_outputs", msg)

        set_ = [f for f in ("json", "regex", "choice", "grammar") if getattr(self, f) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            bad(f"needs exactly one of json, regex, choice, grammar, json_object; got {set_ or 'none'}")
        if not isinstance(self.disable_any_whitespace, bool):
            bad(f"disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            bad(f"json must be a JSON schema (a dict or its JSON text), got {type(self.json).__name__}")
        for f in ("regex", "grammar"):
            if getattr(self, f) is not None and not isinstance(getattr(self, f), str):
                bad(f"{f} must be a string, got {getattr(self, f)!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                bad(f"choice must be a non-empty list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object is not None and not isinstance(self.json_object, bool):
            bad(f"json_object must be a bool, got {self.json_object!r}")
        from jspec.engine.structured import check_grammar  # llguidance: loaded with the first request

        check_grammar(self.key)

    @functools.cached_property
    def key(self) -> tuple[str, str, bool]:
        """(kind, spec text, flexible whitespace): what the compiled grammar depends on."""
        import json as _json

        if self.json is not None or self.json_object:
            schema = self.json if self.json is not None else {"type": "object"}
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise SamplingParamsError("structured_outputs", f"json is not valid JSON: {e}") from None
            try:
                text = _json.dumps(schema, sort_keys=True, separators=(",", ":"))
            except (TypeError, ValueError) as e:
                raise SamplingParamsError("structured_outputs", f"json is not JSON-serializable: {e}") from None
            return "json", text, not self.disable_any_whitespace
        if self.choice is not None:
            return "choice", _json.dumps(list(self.choice)), True
        kind = "regex" if self.regex is not None else "grammar"
        return kind, getattr(self, kind), True

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, StructuredOutputsParams) and self.key == other.key


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    # jspec's first fields, in their original order (positional calls keep working), then vLLM's others.
    temperature: float = 1.0  # 0 -> greedy
    top_k: int = 0  # <= 0 -> off (vLLM also accepts -1)
    top_p: float = 1.0  # 1 -> off
    max_tokens: int = 16
    seed: int | None = None  # None -> the engine draws one (still stateless per position)
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    n: int = 1  # independent samples of the prompt (RequestOutput.outputs); greedy needs n = 1
    min_p: float = 0.0  # keep tokens with p >= min_p * max p (after temperature); 0 -> off
    presence_penalty: float = 0.0  # [-2, 2]: logit -= p * (token in the output so far)
    frequency_penalty: float = 0.0  # [-2, 2]: logit -= p * (its count in the output so far)
    repetition_penalty: float = 1.0  # > 0: tokens in the prompt or output: logit / r if > 0 else * r
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings do not end the output before this
    stop: str | tuple[str, ...] | None = None  # strings that end the output (cut from the text)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N log-probabilities per output token (+ the sampled one); -1: all
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled
    bad_words: tuple[str, ...] | None = None  # words whose last token is banned once the rest matches
    skip_special_tokens: bool = True  # in the detokenized text (and so for stop strings)
    # JSON schema / regex / choice / grammar the output must match (a dict of the same fields works too)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        def bad(field, msg):
            raise SamplingParamsError(field, msg)

        def put(field, value):
            object.__setattr__(self, field, value)

        if not _int(self.n) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not _number(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _int(self.top_k) or self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -2 <= v <= 2:
                bad(name, f"must be in [-2, 2], got {v!r}")
        if not _number(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty!r}")
        if not _int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if self.seed is not None and (not _int(self.seed) or not 0 <= self.seed < 2**63):
            bad("seed", f"must be a non-negative integer, got {self.seed!r}")
        if self.n > 1 and self.greedy:
            bad("n", f"must be 1 with greedy sampling (temperature 0): the {self.n} samples would be equal")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is True:  # vLLM reads True as 1
                put(name, v := 1)
            if v is not None and (not _int(v) or v < -1):
                bad(name, f"must be None, -1 (the whole vocabulary) or an integer >= 0, got {v!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be a bool, got {getattr(self, name)!r}")
        put("stop", self._strings("stop", self.stop, bad))
        put("bad_words", self._strings("bad_words", self.bad_words, bad))
        put("stop_token_ids", self._ids("stop_token_ids", self.stop_token_ids, bad))
        put("allowed_token_ids", self._ids("allowed_token_ids", self.allowed_token_ids, bad))
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            bad("allowed_token_ids", "must not be empty (nothing could be sampled)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", f"must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            lb = {}
            for k, v in self.logit_bias.items():
                try:  # the OpenAI API sends the ids as JSON object keys: strings
                    tid = int(k)
                except (TypeError, ValueError):
                    bad("logit_bias", f"key {k!r} is not a token id")
                if isinstance(k, bool) or isinstance(k, float) or not _number(v):
                    bad("logit_bias", f"entry {k!r}: {v!r} is not token id -> finite number")
                lb[tid] = min(100.0, max(-100.0, float(v)))  # vLLM's clamp
            put("logit_bias", lb)
        so = self.structured_outputs
        if isinstance(so, dict):
            try:
                so = StructuredOutputsParams(**so)
            except TypeError as e:
                bad("structured_outputs", f"has an unknown field: {e}")
            put("structured_outputs", so)
        if so is not None and not isinstance(so, StructuredOutputsParams):
            bad("structured_outputs", f"must be a StructuredOutputsParams or a dict, got {type(so).__name__}")

    @staticmethod
    def _strings(field, v, bad):
        """None | str | list of non-empty str -> None | tuple[str, ...] (duplicates dropped)."""
        if v is None:
            return None
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) for s in v):
            bad(field, f"must be a string or a list of strings, got {v!r}")
        if any(not s for s in v):
            bad(field, "must not contain an empty string")
        return tuple(dict.fromkeys(v)) or None

    @staticmethod
    def _ids(field, v, bad):
        """None | iterable of non-negative ints -> None | tuple[int, ...] (vocabulary checked by the engine)."""
        if v is None:
            return None
        try:
            ids = list(v)
        except TypeError:
            bad(field, f"must be a list of token ids, got {v!r}")
        for t in ids:
            if not isinstance(t, int) and not (hasattr(t, "dtype") and getattr(t, "ndim", 1) == 0
                                               and str(t.dtype).startswith(("int", "uint"))):
                bad(field, f"must contain integer token ids, got {t!r}")
            if isinstance(t, bool) or int(t) < 0:
                bad(field, f"must contain token ids >= 0, got {t!r}")
        return tuple(int(t) for t in ids)

    def __hash__(self):  # logit_bias is a dict (as vLLM's): hashed as its sorted items
        return hash(tuple((f.name, tuple(sorted(v.items())) if isinstance(v := getattr(self, f.name), dict) else v)
                          for f in dataclasses.fields(self)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.stop or ()

    @property
    def uses_processors(self) -> bool:
        """Does this request need the logits processors (jspec/engine/logits_processing.py)?"""
        return bool(
            self.min_p > 0 and not self.greedy or self.presence_penalty or self.frequency_penalty
            or self.repetition_penalty != 1.0 or self.min_tokens or self.logit_bias
            or self.allowed_token_ids is not None or self.bad_words
        )

    def verify(self, vocab_size: int, tokenizer, max_logprobs: int) -> list[list[int]]:
        """The checks that need the model (vLLM's SamplingParams.verify): token ids in the
        vocabulary, logprobs within the engine's ``max_logprobs`` (-1: the vocabulary), a
        tokenizer for ``stop`` and ``bad_words``. Returns bad_words tokenized."""
        def bad(field, msg):
            raise SamplingParamsError(field, msg)

        for field, ids in (("stop_token_ids", self.stop_token_ids), ("allowed_token_ids", self.allowed_token_ids),
                           ("logit_bias", tuple(self.logit_bias or ()))):
            out = [t for t in ids or () if not 0 <= t < vocab_size]
            if out:
                bad(field, f"has token ids outside the vocabulary [0, {vocab_size}): {out[:8]}")
        limit = vocab_size if max_logprobs == -1 else max_logprobs
        for field in ("logprobs", "prompt_logprobs"):
            v = getattr(self, field)
            if v is not None and (vocab_size if v == -1 else v) > limit:
                bad(field, f"asks for {v} log-probabilities per token, above the engine's max_logprobs={limit}")
        for field in ("stop", "bad_words", "structured_outputs"):
            if getattr(self, field) and tokenizer is None:
                bad(field, "needs a tokenizer, and the model folder has none")
        ids = tokenize_bad_words(tokenizer, self.bad_words) if self.bad_words else []
        for w in ids:
            if len(w) > MAX_BAD_WORD_TOKENS or not all(0 <= t < vocab_size for t in w):
                bad("bad_words", f"entry tokenizes to {w}: more than {MAX_BAD_WORD_TOKENS} tokens, or ids "
                                 f"outside the vocabulary [0, {vocab_size})")
        if len(ids) > MAX_BAD_WORDS:
            bad("bad_words", f"tokenizes to {len(ids)} token sequences, above the limit of {MAX_BAD_WORDS}")
        return ids


MAX_BAD_WORDS = 128  # token sequences per request (vLLM's default limit)
MAX_BAD_WORD_TOKENS = 32  # tokens per bad word (the device table's width is a power of two up to it)


def tokenize_bad_words(tokenizer, words) -> list[list[int]]:
    """vLLM's bad_words tokenization: each word as written (left-stripped) and, when that
    gives a different first token and the same length, with a leading space (the word in
    the middle of a text)."""
    out: list[list[int]] = []
    for word in words or ():
        for space in (False, True):
            ids = [int(t) for t in tokenizer.encode((" " if space else "") + word.lstrip(), add_special_tokens=False)]
            if not ids:
                if not space:
                    raise SamplingParamsError("bad_words", f"entry {word!r} tokenizes to no token")
                continue
            if not space or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return out
