"""A Transformer's decoder layers run as calls of one jitted function per kind of layer
(jspec.models.transformer.apply_layer): a step's program holds one layer body, whatever the
number of layers, which jax traces once and lowers once (issue 57: unrolled, the layers were
most of what warmup spent tracing and lowering on the server's main thread). The outputs are
the unrolled layers' (tests/models/test_transformer_parity.py checks them against
transformers)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from jspec import family
from jspec.checkpoint.target import load_target
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.transformer import Transformer

PAGE, NPAGES = 16, 4


def lowered_forward(cfg, params):
    """The StableHLO text of one forward over 8 tokens."""
    model = Transformer(cfg)
    kv = KVCache.create(cfg.num_layers, NPAGES, PAGE, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    meta = AttentionMetadata.for_single_sequence([2, 0], PAGE, 0, 8, NPAGES)

    def fwd(params, kv, tokens, meta):
        return model.apply({"params": params}, tokens, meta, kv)[0]

    return jax.jit(fwd).lower(params, kv, jnp.arange(3, 11, dtype=jnp.int32)[None], meta).as_text()


def layer_bodies_and_calls(text: str) -> tuple[int, int]:
    bodies = re.findall(r"func\.func private @(_apply_layer\w*)", text)
    calls = sum(len(re.findall(rf"call @{b}\(", text)) for b in bodies)
    return len(bodies), calls


def layers(n: int, **changes):
    """The family's target with ``n`` copies of its first layer."""
    cfg, params = load_target(family.TARGET, "float32")
    params = jax.tree.map(np.asarray, params)
    return (dataclasses.replace(cfg, num_layers=n, **changes),
            dict(params, **{f"layers_{i}": params["layers_0"] for i in range(n)}))


def test_one_layer_body_for_every_layer():
    """Six layers, two bodies: the layers that hand their output's norm to the next one
    (ops.mlp's next_norm), and the last, which does not."""
    # (jax reuses a lowered body for the same traced jaxpr object: two bodies, two traces)
    bodies, calls = layer_bodies_and_calls(lowered_forward(*layers(6)))
    assert (bodies, calls) == (2, 6)


def test_a_body_per_kind_of_layer():
    """Sliding-window layers beside full-attention ones (gpt-oss's alternation): a sliding
    kind, a full kind and the last layer."""
    bodies, calls = layer_bodies_and_calls(lowered_forward(*layers(6, sliding_window=4, sliding_layers=(0, 2, 4))))
    assert (bodies, calls) == (3, 6)
