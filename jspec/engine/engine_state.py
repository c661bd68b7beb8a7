"""The device state a step reads and returns: one pytree, donated to every jitted step
(updated in place) and put back whole after a step that failed on the device
(jspec/engine/recovery.py)."""

from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class EngineState:
    kv: object  # the target's paged KV cache (jspec.kv_cache.KVCache: k, v [L] x [P, page, Hkv, D])
    dkv: object = None  # the drafter's cache over the same page ids (a KVCache, the n-gram TokenHistory) or None
    probs: jax.Array | None = None  # f32[max_num_seqs, K, V]: the drafts' probabilities between steps
    #                                 (probabilistic verification; a request's row: FlatRunner._prob_rows)
