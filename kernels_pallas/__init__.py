"""Pallas kernels with jnp references. Each kernel file holds its contract (validation,
``supports`` / ``unsupported_shape``), the jnp reference and the kernels' entries; which one
runs is chosen in jspec/ops.py from the engine's KernelPlan."""

from kernels_pallas.rejection_sampling import gpu_kernels, ref_rejection_sample, rejection_sample, tpu_kernels

__all__ = ["gpu_kernels", "rejection_sample", "ref_rejection_sample", "tpu_kernels"]
