"""When an output ends (plain Python, vLLM's rules), and the incremental text stop strings need.

Per emitted token, in order: max_model_len and max_tokens ("length"); before ``min_tokens``
tokens nothing else ends the output (the logits processors also mask EOS and
``stop_token_ids`` until then); EOS (unless ``ignore_eos``; stop_reason None) and
``stop_token_ids`` (stop_reason the id) end it with "stop", the token kept in ``token_ids``;
a stop string ends it with "stop" (stop_reason the string) once the detokenized text
contains it, even across token boundaries: ``token_ids`` keep the token that completed it,
the text is cut before the string (or after it with ``include_stop_str_in_output``).
Tokens a step emitted after the stopping one are dropped.
"""

from __future__ import annotations

from jspec.engine.sequence import Sequence


class IncrementalText:
    """The detokenized text of a growing list of token ids, one decode of a few tokens per
    update (vLLM's prefix/read offsets): the tokens since ``prefix`` are decoded with and
    without the new ones and the difference appended. A trailing U+FFFD (a multi-byte
    character cut between tokens) is held until the token that completes it."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.prefix = 0  # first token of the decode window
        self.read = 0  # tokens whose text is in ``text``
        self.text = ""

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def update(self, ids: list[int]) -> str:
        """Text added by ``ids[self.read:]`` (ids: every output token so far)."""
        before = self._decode(ids[self.prefix : self.read])
        full = self._decode(ids[self.prefix :])
        if len(full) <= len(before) or full.endswith("\ufffd"):
            return ""
        delta = full[len(before) :]
        self.prefix, self.read = self.read, len(ids)
        self.text += delta
        return delta


def find_stop_string(text: str, new: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string that ends in the last ``new``
    characters of ``text`` (it may start before them: a string spanning tokens)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, len(text) - new - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def append_tokens(seq: Sequence, tokens: list[int], eos_token_ids, max_model_len: int, tokenizer) -> list[int]:
    """Append emitted tokens to ``seq`` up to the first that ends it; sets
    ``seq.finish_reason`` / ``seq.stop_reason`` (and ``seq.stop_text``, the text cut at a
    stop string). Returns the tokens appended."""
    p = seq.params
    stops = p.stop_strings
    if stops and seq.detok is None:
        seq.detok = IncrementalText(tokenizer, p.skip_special_tokens)
    new = []
    for t in tokens:
        seq.output_token_ids.append(t)
        new.append(t)
        n = len(seq.output_token_ids)
        if n > p.min_tokens:
            if not p.ignore_eos and t in eos_token_ids:
                seq.finish_reason = "stop"
            elif p.stop_token_ids and t in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", t
            elif stops:
                delta = seq.detok.update(seq.output_token_ids)
                hit = find_stop_string(seq.detok.text, len(delta), stops) if delta else None
                if hit is not None:
                    i, s = hit
                    seq.finish_reason, seq.stop_reason = "stop", s
                    seq.stop_text = seq.detok.text[: i + len(s) if p.include_stop_str_in_output else i]
        elif stops:
            seq.detok.update(seq.output_token_ids)  # keep the text current for the strings later
        if seq.finish_reason is None and (n >= p.max_tokens or seq.num_tokens >= max_model_len):
            seq.finish_reason = "length"
        if seq.finish_reason:
            break
    return new
