"""Pallas kernels with jnp references; one dispatch point (dispatch.resolve_impl)."""

from kernels_pallas.dispatch import resolve_impl
from kernels_pallas.rejection_sampling import ref_rejection_sample, rejection_sample

__all__ = ["rejection_sample", "ref_rejection_sample", "resolve_impl"]
