"""The tensor-parallel mesh, the configurations it accepts, and the KV cache's sharding.

Every check raises a ValueError naming the numbers: a tensor-parallel size that does not
divide the attention heads, the KV heads (nor is divided by them) or the intermediate size,
or that asks for more devices than JAX sees. Any vocabulary splits: a table tp does not
divide is padded (``padded_vocab``).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

TP_AXIS = "tp"


def make_mesh(tp: int) -> Mesh | None:
    """A 1-D mesh ("tp") over the first ``tp`` devices; None for tp == 1 (one device, no
    mesh: the engine runs exactly as without tensor parallelism). Across hosts,
    ``jax.distributed.initialize()`` first makes every host's devices visible here."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
    if tp == 1 and jax.process_count() == 1:
        return None
    devices = jax.devices()
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} asks for more devices than exist: jax sees {len(devices)} "
                         f"{jax.default_backend()} device(s)")
    if jax.process_count() > 1 and tp != len(devices):
        raise ValueError(f"tensor_parallel_size={tp}: over {jax.process_count()} nodes the model spans every "
                         f"device of every node, {len(devices)}")
    return Mesh(np.asarray(devices[:tp]), (TP_AXIS,))


@dataclasses.dataclass
class EngineMesh:
    """An engine's tensor parallelism: the mesh (None at tp 1: one device, as without it),
    the target's size and the drafter's (``resolve_draft_tp``), and what follows from them."""

    mesh: Mesh | None
    tp: int
    draft_tp: int = 1

    @classmethod
    def create(cls, tp: int, sharding=None, preloaded=None) -> EngineMesh:
        """At tp > 1 the engine places the weights itself: no ``sharding``, no preloaded
        params (load_format="dummy" gives random ones)."""
        mesh = make_mesh(tp)
        if mesh is not None and (sharding is not None or preloaded is not None):
            raise ValueError("tensor_parallel_size > 1 places the weights itself: no sharding or preloaded params "
                             "(load_format='dummy' gives random weights)")
        return cls(mesh, tp)

    def _size(self, draft: bool) -> int:
        return self.draft_tp if draft else self.tp

    def placement(self, sharding=None, draft: bool = False):
        """What the target's (``draft``: the drafter's) weights are loaded onto: a Placement
        on the mesh, else ``sharding`` as given."""
        from jspec.parallel.placement import Placement

        return sharding if self.mesh is None else Placement(self.mesh, self._size(draft))

    def kv_sharding(self, num_kv_heads: int, draft: bool = False):
        return kv_sharding(self.mesh, num_kv_heads, self._size(draft))

    def local_kv_heads(self, num_kv_heads: int, draft: bool = False) -> int:
        return local_kv_heads(num_kv_heads, self._size(draft))

    def plan_args(self) -> dict:
        """plan_kernels' tensor-parallel arguments."""
        return dict(tp=self.tp, draft_tp=self.draft_tp, mesh=self.mesh)


def resolve_draft_tp(draft_tp: int | None, tp: int) -> int:
    """The drafter's tensor-parallel size: None -> the target's (vLLM's default); else 1
    (the drafter replicated on every device of the mesh) or the target's."""
    if draft_tp is None:
        return tp
    if draft_tp not in (1, tp):
        raise ValueError(f"draft_tensor_parallel_size={draft_tp} must be 1 (a replicated drafter) or "
                         f"tensor_parallel_size={tp}")
    return draft_tp


def _divides(tp: int, what: str, flag: str, **sizes):
    for name, n in sizes.items():
        if n % tp:
            raise ValueError(f"{flag}={tp} does not divide the {what}'s {name}={n}")


def _kv_heads(tp: int, what: str, flag: str, kv_heads: int, head_dim: int):
    # KV heads are sharded when tp divides them, else replicated (tp a multiple of them);
    # their projection's output columns are split evenly either way.
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"{flag}={tp}: the {what}'s num_key_value_heads={kv_heads} must be a multiple of it "
                         f"(KV cache sharded by head) or divide it (KV cache replicated)")
    _divides(tp, what, flag, **{"num_key_value_heads * head_dim": kv_heads * head_dim})


def check_target(cfg, tp: int):
    """ValueError unless the target (a ModelConfig) splits over ``tp`` devices."""
    if tp == 1:
        return
    flag = "tensor_parallel_size"
    if cfg.moe_layers:
        raise ValueError(f"{flag}={tp}: a mixture-of-experts target (num_experts={cfg.num_experts}) runs on one "
                         f"device in jspec; its experts are not split over devices")
    _divides(tp, "target", flag, num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size)
    _kv_heads(tp, "target", flag, cfg.num_kv_heads, cfg.head_dim)


def check_drafter(cfg, tp: int):
    """ValueError unless the drafter (a DrafterConfig) splits over ``tp`` devices."""
    if tp == 1:
        return
    flag = "draft_tensor_parallel_size"
    sizes = {"num_attention_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size,
             "fc input (aux states x target hidden)": cfg.fc_in_features}
    _divides(tp, "drafter", flag, **sizes)
    _kv_heads(tp, "drafter", flag, cfg.num_kv_heads, cfg.head_dim)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The rows a vocabulary-split table (an embedding, an lm_head: ParamSpec.vocab) is held
    with over ``tp`` devices: ``vocab_size`` rounded up to a multiple of tp, so each device
    holds as many rows. The extra rows are zero (Placement) and their logits are sliced off
    right after the lm_head (ops.logits): no sampler, logprob or mask sees them. vLLM pads
    to a multiple of 64 * tp for its GPU kernels; XLA needs no such alignment, and the
    fewest rows keep each device's bytes at total / tp."""
    return -(-vocab_size // tp) * tp


def kv_sharding(mesh: Mesh | None, num_kv_heads: int, tp: int):
    """The paged cache's sharding ([P, S, KVH, D] per layer): by KV head where ``tp``
    divides them, replicated otherwise (and for a replicated drafter, tp == 1). None
    without a mesh (the default device)."""
    if mesh is None:
        return None
    heads = TP_AXIS if tp > 1 and num_kv_heads % tp == 0 else None
    return NamedSharding(mesh, P(None, None, heads, None))


def replicate(x, mesh: Mesh | None):
    """``x`` replicated on ``mesh`` (as is without one): a stand-in for a step output that
    is fed back into the next call, committed to the same sharding so the two calls share
    one executable."""
    return x if mesh is None else put(x, NamedSharding(mesh, P()))


def put(x, sharding):
    """jax.device_put(x, sharding); on a mesh over several hosts each host places its own
    devices' blocks of ``x`` (every host holds the same value): device_put would first
    compare the whole value across hosts, a collective per array."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def local_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads each device's cache holds (kv_sharding)."""
    return num_kv_heads // tp if num_kv_heads % tp == 0 else num_kv_heads


def device_param_bytes(params) -> dict:
    """{device: bytes of ``params`` stored on it} (each device's shards of every leaf)."""
    out: dict = {}
    for leaf in jax.tree.leaves(params):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out
