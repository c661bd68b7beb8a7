"""Tensor parallelism over a device mesh (``tensor_parallel_size``, vLLM's name).

One mesh axis, "tp", over the first ``tensor_parallel_size`` devices (``make_mesh``).
Parameters are sharded Megatron-style through their ``ParamSpec.split`` (jspec/checkpoint/
param_spec.py), loaded slice by slice (``Placement``), the KV cache by KV head
(``kv_sharding``), and JAX's SPMD partitioner turns the jitted steps into per-device
programs with the collectives they need (docs/architecture.md, "Tensor parallelism").
"""

from jspec.parallel.mesh import (
    TP_AXIS,
    EngineMesh,
    check_drafter,
    check_target,
    device_param_bytes,
    kv_sharding,
    local_kv_heads,
    make_mesh,
    padded_vocab,
    replicate,
    resolve_draft_tp,
)
from jspec.parallel.placement import Placement

__all__ = [
    "TP_AXIS", "EngineMesh", "Placement", "check_drafter", "check_target", "device_param_bytes", "kv_sharding",
    "local_kv_heads", "make_mesh", "padded_vocab", "replicate", "resolve_draft_tp",
]
