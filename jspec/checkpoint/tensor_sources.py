"""The tensors of a checkpoint folder, whatever file holds them: ``open_tensor_source``.

A tensor source (``SafetensorsReader`` or ``BinReader``) answers ``name in src``,
``names()``, ``shape(name)``, ``is_float(name)``, ``dtype(name)``, ``get(name)`` (floats, cast by the caller), ``get_int(name)``
(integer maps, exact), ``get_part(name, index)`` (a slice, for tensor parallelism),
``is_fp8(name)`` and ``get_fp8(name)`` (FP8 weights, as ml_dtypes' float8_e4m3fn),
``nbytes()`` and ``close()``, and is a context manager; target and
drafter loaders read through it alike (jspec/checkpoint/param_spec.py).
"""

from __future__ import annotations

import os

import numpy as np

from jspec.checkpoint.safetensors_io import CheckpointError, SafetensorsReader


class BinReader:
    """``pytorch_model.bin`` through torch.load(weights_only=True)."""

    def __init__(self, fn: str):
        try:
            import torch
        except ImportError:
            raise CheckpointError(f"{fn}: reading pytorch_model.bin needs torch, which is not installed") from None
        self.fn = fn
        self.folder = os.path.dirname(fn)
        self.tensors = torch.load(fn, map_location="cpu", weights_only=True)

    def __contains__(self, name):
        return name in self.tensors

    def names(self):
        return self.tensors.keys()

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def is_float(self, name) -> bool:
        return self.tensors[name].is_floating_point()

    def dtype(self, name) -> str:
        return str(self.tensors[name].dtype).removeprefix("torch.")

    def get(self, name) -> np.ndarray:
        t = self.tensors[name]
        # numpy has no bfloat16: widen floats to float32 before the final cast.
        return (t.float() if t.is_floating_point() else t).numpy()

    get_int = get  # torch keeps integer tensors exact

    def is_fp8(self, name) -> bool:
        import torch

        return self.tensors[name].dtype == torch.float8_e4m3fn

    def get_fp8(self, name) -> np.ndarray:
        import ml_dtypes
        import torch

        return self.tensors[name].contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)

    def get_part(self, name, index: tuple) -> np.ndarray:
        # torch.load has already read the whole file: a slice saves device memory, not host memory.
        return self.get(name)[index]

    def nbytes(self) -> int:
        return os.path.getsize(self.fn)

    def close(self):
        self.tensors = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_tensor_source(folder: str) -> SafetensorsReader | BinReader:
    """safetensors (single or sharded) first; else pytorch_model.bin."""
    has_st = any(os.path.exists(os.path.join(folder, f)) for f in ("model.safetensors", "model.safetensors.index.json"))
    if has_st:
        return SafetensorsReader(folder)
    binf = os.path.join(folder, "pytorch_model.bin")
    if os.path.exists(binf):
        return BinReader(binf)
    raise CheckpointError(f"no model.safetensors, model.safetensors.index.json or pytorch_model.bin in {folder!r}")
