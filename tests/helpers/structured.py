"""JSON schemas of varied shape for the structured-outputs tests (tests/e2e, tests/serve,
scripts/gpu_check.py), each finite (bounded strings and arrays, enums, bounded integers,
every key required, no other keys) so that a masked model always completes them, and the
independent check of an output against its schema (``jsonschema``)."""

from __future__ import annotations

import json
import random

import jsonschema

WORDS = ["red", "green", "blue", "on", "off", "yes", "no", "alpha", "beta", "x"]


def _value(rng: random.Random, depth: int) -> dict:
    kinds = ["int", "bool", "enum", "str", "array"] + (["object"] if depth < 2 else [])
    k = rng.choice(kinds)
    if k == "int":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([0, 9, 100, 1000])}
    if k == "bool":
        return {"type": "boolean"}
    if k == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if k == "str":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if k == "array":
        lo = rng.randint(0, 2)
        item = rng.choice([{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": rng.sample(WORDS, 2)},
                           {"type": "boolean"}])
        return {"type": "array", "items": item, "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    return _object(rng, depth + 1, rng.randint(1, 2))


def _object(rng: random.Random, depth: int, n: int) -> dict:
    props = {f"k{i}_{rng.choice(WORDS)}": _value(rng, depth) for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def schemas(n: int = 50, seed: int = 0) -> list[dict]:
    """n schemas: objects of 1 to 4 keys, nested to depth 2, arrays with minItems / maxItems,
    enums, integers with minimum / maximum, booleans, strings with maxLength."""
    rng = random.Random(seed)
    return [_object(rng, 0, rng.randint(1, 4)) for _ in range(n)]


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(props if required is None else required)}


_S, _I, _N, _B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}

# Schemas as users write them (unbounded strings and numbers, open objects, optional keys, unions,
# patterns), the README's example first: a model left to itself need never finish these.
USER_SCHEMAS = [
    _obj({"city": _S}),
    _obj({"name": _S, "age": _I}),
    _obj({"ok": _B}),
    _obj({"x": _N, "y": _N}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"tags": {"type": "array", "items": _S, "maxItems": 3}}),
    _obj({"point": _obj({"x": _I, "y": _I})}),
    _obj({"id": _I, "title": _S, "done": _B}),
    _obj({"values": {"type": "array", "items": _I, "minItems": 1}}),
    _obj({"name": _S, "nickname": _S}, required=["name"]),
    _obj({"kind": {"const": "user"}, "id": _I}),
    _obj({"result": {"anyOf": [_I, _S]}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
    _obj({"score": {"type": "integer", "minimum": 0, "maximum": 100}}),
    _obj({"items": {"type": "array", "items": _obj({"n": _I})}}),
    _obj({"value": {"type": ["string", "null"]}}),
    _obj({"a": _obj({"b": _obj({"c": _S})})}),
    _obj({"word": {"type": "string", "maxLength": 12}}),
    _obj({"answer": {"enum": ["yes", "no"]}, "confidence": _N}),
    _obj({"first": _S, "last": _S, "email": _S}),
]
