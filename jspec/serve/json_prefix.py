"""How far a string is a JSON object: whole, a prefix that more text could still complete,
or past saving; with where each top-level member's value starts and ends.

The tool-call parsers (jspec/serve/tool_parsers.py) read a call's name and arguments out
of JSON the model is still writing, and give a call up as text as soon as no continuation
could make it JSON. Strict JSON, as json.loads with NaN and Infinity refused: what the
scan accepts whole, json.loads reads (one more json.loads of the same text gives the same
verdict, so the streamed and the whole parse agree).
"""

from __future__ import annotations

import dataclasses
import json
import re

_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_RUN = re.compile(r"-?[0-9]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")  # the characters a number spans
# what a number may begin as: the text ending there may still become one
_NUMBER_PREFIX = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]*)?|(?:0|[1-9][0-9]*)\.)?")
_PLAIN = re.compile(r'[^"\\\x00-\x1f]*')  # a run of string characters with nothing to check
_HEX = set("0123456789abcdefABCDEF")


class _End(Exception):
    """The text ended inside the value: a prefix, so far."""


class _Bad(Exception):
    """No continuation makes this JSON."""


@dataclasses.dataclass
class Scan:
    state: str  # "complete", "partial" (a prefix of some JSON object) or "invalid"
    end: int | None  # complete: the index just past the object
    # top-level members whose key is whole: key -> (value start, value end; None while open)
    members: dict[str, tuple[int, int | None]]

    def value(self, s: str, key: str):
        """The member's value decoded, or None while it is open or absent."""
        span = self.members.get(key)
        if span is None or span[1] is None:
            return None
        return json.loads(s[span[0]:span[1]])


def scan_object(s: str, i: int = 0) -> Scan:
    """Scan the JSON object that starts at ``s[i]`` (after whitespace); text after it is
    not looked at."""
    members: dict[str, tuple[int, int | None]] = {}
    i = _ws(s, i)
    if i == len(s):
        return Scan("partial", None, members)
    if s[i] != "{":
        return Scan("invalid", None, members)
    try:
        return Scan("complete", _object(s, i, members), members)
    except _End:
        return Scan("partial", None, members)
    except (_Bad, RecursionError):  # RecursionError: nesting deeper than json.loads reads either
        return Scan("invalid", None, members)


def _ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _value(s: str, i: int) -> int:
    """The index just past the value starting at s[i] (no whitespace before it)."""
    c = s[i]
    if c == "{":
        return _object(s, i, None)
    if c == "[":
        return _array(s, i)
    if c == '"':
        return _string(s, i)
    if c == "-" or c.isdigit():
        return _number(s, i)
    for lit in ("true", "false", "null"):
        if s.startswith(lit, i):
            return i + len(lit)
        if lit.startswith(s[i:]):
            raise _End
    raise _Bad


def _more(s: str, i: int) -> int:
    """The index of the next character after whitespace; the text must go on there."""
    i = _ws(s, i)
    if i == len(s):
        raise _End
    return i


def _after(s: str, i: int, close: str) -> tuple[int, bool]:
    """After a member or an item of a container that ``close`` ends: (the index past the
    close, True) or (the next member's or item's, False)."""
    i = _more(s, i)
    if s[i] == close:
        return i + 1, True
    if s[i] != ",":
        raise _Bad
    return _more(s, i + 1), False


def _object(s: str, i: int, members: dict | None) -> int:
    i = _more(s, i + 1)
    if s[i] == "}":
        return i + 1
    while True:
        if s[i] != '"':
            raise _Bad
        k = _string(s, i)
        key = json.loads(s[i:k])
        i = _more(s, k)
        if s[i] != ":":
            raise _Bad
        i = _more(s, i + 1)
        if members is not None:
            members[key] = (i, None)
        end = _value(s, i)
        if members is not None:
            members[key] = (i, end)
        i, done = _after(s, end, "}")
        if done:
            return i


def _array(s: str, i: int) -> int:
    i = _more(s, i + 1)
    if s[i] == "]":
        return i + 1
    while True:
        i, done = _after(s, _value(s, i), "]")
        if done:
            return i


def _string(s: str, i: int) -> int:
    j = i + 1
    while True:
        j = _PLAIN.match(s, j).end()
        if j == len(s):
            raise _End
        c = s[j]
        if c == '"':
            return j + 1
        if c != "\\":
            raise _Bad  # a raw control character
        if j + 1 == len(s):
            raise _End
        e = s[j + 1]
        if e == "u":
            digits = s[j + 2:j + 6]
            if not all(h in _HEX for h in digits):
                raise _Bad
            if len(digits) < 4:
                raise _End
            j += 6
        elif e in '"\\/bfnrt':
            j += 2
        else:
            raise _Bad


def _number(s: str, i: int) -> int:
    run = _NUMBER_RUN.match(s, i).end()
    if run == len(s):  # the text ends in the number: more of it may follow
        if _NUMBER_PREFIX.fullmatch(s, i):
            raise _End
        raise _Bad
    whole = _NUMBER.match(s, i)
    if whole is None or whole.end() != run:
        raise _Bad
    return run
