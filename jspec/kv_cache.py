"""Device state of the paged KV cache and the per-step attention metadata (pytrees).

Shapes (P = num_pages, S = page_size, B = batch bucket, Q = query bucket,
W = page-table width bucket):
  KVCache.k[l], KVCache.v[l]:  [P, S, kv_heads, head_dim] per layer l
  AttentionMetadata.page_table: i32[B, W]   page ids of each sequence, in order
  AttentionMetadata.kv_lens:    i32[B]      keys valid after this step's writes
  AttentionMetadata.positions:  i32[B, Q]   position of each query token
  AttentionMetadata.slot_mapping: i32[B, Q] flat slot page*S+offset to write; P*S = drop
  AttentionMetadata.causal:     bool[B]     False: queries see all kv_lens keys (DFlash)

A flat step (jspec/engine/flat_input.py) runs its T tokens as one row [1, T] with
``RaggedMetadata``: sequence i owns tokens cu_q_lens[i] .. cu_q_lens[i + 1] - 1.

Per-layer arrays (rather than one stacked [L, ...] array) let XLA update each layer's
buffer in place under donation without slicing a giant array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: tuple  # of [P, S, KVH, D]
    v: tuple  # of [P, S, KVH, D]

    @classmethod
    def create(cls, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, sharding=None):
        shape = (num_pages, page_size, num_kv_heads, head_dim)

        def z():
            return jnp.zeros(shape, dtype, device=sharding)

        return cls(k=tuple(z() for _ in range(num_layers)), v=tuple(z() for _ in range(num_layers)))

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]


@struct.dataclass
class AttentionMetadata:
    page_table: jax.Array  # i32[B, W]
    kv_lens: jax.Array  # i32[B]
    positions: jax.Array  # i32[B, Q]
    slot_mapping: jax.Array  # i32[B, Q]
    causal: jax.Array  # bool[B]

    @classmethod
    def for_single_sequence(cls, pages, page_size, start, q_len, num_pages):
        """Metadata for one sequence writing tokens [start, start + q_len) (tests, tools)."""
        import numpy as np

        pos = np.arange(start, start + q_len, dtype=np.int32)
        pages = np.asarray(pages, np.int32)
        slots = pages[pos // page_size] * page_size + pos % page_size
        return cls(
            page_table=jnp.asarray(pages[None]),
            kv_lens=jnp.asarray([start + q_len], jnp.int32),
            positions=jnp.asarray(pos[None]),
            slot_mapping=jnp.asarray(slots[None].astype(np.int32)),
            causal=jnp.ones((1,), bool),
        )


@struct.dataclass
class MixedMetadata:
    """A step of several row segments (jspec/engine/mixed.py: decode rows [Bd, 1] and
    prefill chunks [Bp, Qp]) whose tokens run flattened as one [1, N] row through the
    dense layers (N = sum of B_i * Q_i, segment by segment): ``positions`` and
    ``slot_mapping`` are the segments' flattened, and attention runs once per segment
    with the segment's own metadata (jspec.ops.attention)."""

    segments: tuple  # of AttentionMetadata, segment i over [B_i, Q_i]

    @property
    def positions(self):  # i32[1, N]
        return jnp.concatenate([m.positions.reshape(1, -1) for m in self.segments], axis=1)

    @property
    def slot_mapping(self):  # i32[1, N]
        return jnp.concatenate([m.slot_mapping.reshape(1, -1) for m in self.segments], axis=1)


@struct.dataclass
class RaggedMetadata:
    """The attention metadata of a flat step: T tokens in one row, one contiguous segment
    per sequence (a prefill chunk, a decode token, K + 1 tokens to verify), N sequence
    slots of which ``num_seqs`` are used (kernels_pallas/ragged_paged_attention.py)."""

    positions: jax.Array  # i32[1, T]     position of each token (padding: 0)
    slot_mapping: jax.Array  # i32[1, T]  flat slot to write; P*S = drop (padding)
    cu_q_lens: jax.Array  # i32[N + 1]    segment boundaries
    kv_lens: jax.Array  # i32[N]          keys valid after this step's writes
    page_table: jax.Array  # i32[N, W]
    num_seqs: jax.Array  # i32[1]
    causal: jax.Array  # bool[N]
    # Query windows of the XLA path (kernels_pallas/ragged_attention_xla.py): the longest
    # short segment (decode, verification) and the longest segment of the step's shape.
    windows: tuple[int, int] = struct.field(pytree_node=False, default=(1, 1))
    # > 0: a decode step's rows of this many tokens each, [N, uniform] (row i at i * uniform,
    # its last tokens padding: written nowhere, their outputs unread). Attention then runs as
    # paged attention over [N, uniform] rows (positions explicit), with its tuned kernels.
    uniform: int = struct.field(pytree_node=False, default=0)

    def rows(self) -> AttentionMetadata:
        """The [N, uniform] rows of a decode step, as paged attention's metadata."""
        N, Q = self.page_table.shape[0], self.uniform
        return AttentionMetadata(self.page_table, self.kv_lens, self.positions.reshape(N, Q),
                                 self.slot_mapping.reshape(N, Q), self.causal)
