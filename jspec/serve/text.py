"""Incremental detokenization for streaming, with stop strings."""

from __future__ import annotations


class Detokenizer:
    """Turns the cumulative generated token ids of one request into text deltas.

    Each update decodes all generated tokens and sends what is new. A trailing U+FFFD (maybe a
    multi-byte character cut between tokens) is held back until the next token, and so are the
    last ``len(longest stop string) - 1`` characters, so a stop string is never half-sent.
    When a stop string appears the text is cut before it and ``stopped`` is set.
    (Full re-decode is O(n) per step; fine for the lengths served here.)
    """

    def __init__(self, tokenizer, stop: list[str] | None = None, hold: int | None = None,
                 skip_special_tokens: bool = True):
        """``hold``: characters held back (default: for ``stop``). The server passes no
        ``stop`` (the engine stops on them, and cuts the final text) but holds back for them."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1 if hold is None else hold
        self.sent = ""
        self.stopped = False
        self.text = ""

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, token_ids, finished: bool, final_text: str | None = None) -> str:
        """The new text; ``final_text``: the whole text when finished, as the engine cut it."""
        if self.stopped:
            return ""
        full = final_text if final_text is not None else self.decode(token_ids)
        if self.stop:
            cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                full, finished, self.stopped = full[:cut], True, True
        self.text = full
        ready = full
        if not finished:
            # A trailing U+FFFD may be a multi-byte character cut between tokens: hold back
            # one (lossy UTF-8 decoding turns an incomplete tail into exactly one U+FFFD;
            # earlier ones are invalid bytes and final).
            ready = full[:-1] if full.endswith("\ufffd") else full
            if self.hold:
                ready = ready[: max(0, len(full) - self.hold)]
        # Text already sent cannot be taken back; a decode whose prefix changed (rare) only
        # contributes its new tail.
        if len(ready) <= len(self.sent):
            return ""
        delta, self.sent = ready[len(self.sent):], ready
        return delta
