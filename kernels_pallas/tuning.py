"""Per-device kernel tuning: the facts about the chip that the kernels' tile and grid
choices depend on, by ``jax.Device.device_kind``.

The GPU kernels were tuned on the H200 (docs/benchmarks.md). Their rules (tiles by weight
shape in fused_linear.py and qkv_rope_kv_write.py, kv splits and warps by grid size in
paged_attention_gpu.py) carry over to other devices through the numbers below; a device
not listed takes its SM count from jax when the device reports one (``core_count``), else
the H200's. Lookups happen at trace time (static Python values).
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class DeviceTuning:
    num_sms: int  # streaming multiprocessors: programs per wave of a grid


# NVIDIA's published SM counts.
DEVICES = {
    "NVIDIA H200": DeviceTuning(num_sms=132),
    "NVIDIA H100 80GB HBM3": DeviceTuning(num_sms=132),
    "NVIDIA H100 NVL": DeviceTuning(num_sms=132),
    "NVIDIA H100 PCIe": DeviceTuning(num_sms=114),
    "NVIDIA A100-SXM4-80GB": DeviceTuning(num_sms=108),
    "NVIDIA A100-SXM4-40GB": DeviceTuning(num_sms=108),
    "NVIDIA A100 80GB PCIe": DeviceTuning(num_sms=108),
    "NVIDIA L4": DeviceTuning(num_sms=58),
}
DEFAULT = DEVICES["NVIDIA H200"]  # the device the rules were tuned on


def device_tuning(device=None) -> DeviceTuning:
    """The tuning entry of ``device`` (default: the first device jax sees)."""
    device = device if device is not None else jax.devices()[0]
    kind = getattr(device, "device_kind", "")
    if kind in DEVICES:
        return DEVICES[kind]
    cores = getattr(device, "core_count", None)
    if getattr(device, "platform", "") == "gpu" and isinstance(cores, int) and cores > 0:
        return DeviceTuning(num_sms=cores)
    return DEFAULT
