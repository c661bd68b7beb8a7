"""Reading tensors from a HF folder: ``model.safetensors`` or a sharded index.

Tensors are read one at a time (``safe_open`` maps the file; only the requested tensor is
materialised), so loading never holds a second full copy of the model in host memory.
float8_e4m3fn tensors (FP8 weights), which safetensors' numpy and flax readers cannot make
(numpy has no such dtype), are read from the file's bytes as ml_dtypes' float8_e4m3fn, the
dtype jnp uses (``get_fp8``).
tensor_sources.py picks this reader or the ``pytorch_model.bin`` one for a folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import numpy as np

from jspec.config import read_json_object


class CheckpointError(ValueError):
    """A checkpoint that does not match what the config promises; the message names it."""


def safe_open_checked(fn: str, framework: str):
    """safetensors' ``safe_open``, a CheckpointError naming the file when it cannot be read
    (empty, truncated by an interrupted download, not safetensors at all)."""
    from safetensors import safe_open

    try:
        return safe_open(fn, framework=framework)
    except Exception as e:  # safetensors raises its own SafetensorError, and OSError
        raise CheckpointError(f"{fn} is not a readable safetensors file ({e}): an interrupted download "
                              f"or copy leaves such a file; fetch it again") from None


class SafetensorsReader:
    """Name -> file index over a single file or a sharded checkpoint."""

    def __init__(self, folder: str):
        self.folder = folder
        single = os.path.join(folder, "model.safetensors")
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            weight_map = read_json_object(index, CheckpointError).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map' object")
            self.files = {name: os.path.join(folder, fn) for name, fn in weight_map.items()}
            for fn in set(self.files.values()):
                if not os.path.exists(fn):
                    raise CheckpointError(f"{index} names shard {os.path.basename(fn)!r}, which is missing")
                with safe_open_checked(fn, "np"):  # every shard's header, before any tensor is read
                    pass
        elif os.path.exists(single):
            with safe_open_checked(single, "np") as f:
                self.files = {name: single for name in f.keys()}
        else:
            raise CheckpointError(
                f"no model.safetensors or model.safetensors.index.json in {folder!r}"
            )
        self._handles = {}
        self._headers = {}  # file -> (offset of the data, its header)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> Iterable[str]:
        return self.files.keys()

    def _handle(self, fn):
        if fn not in self._handles:
            # "flax" keeps bfloat16 intact (numpy has no bf16); arrays land on the default
            # device one tensor at a time and are cast / placed by the caller.
            self._handles[fn] = safe_open_checked(fn, "flax")
        return self._handles[fn]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def is_float(self, name: str) -> bool:
        """Is the tensor stored as floating point (F16, BF16, F32, F64, F8_*)?"""
        return self._handle(self.files[name]).get_slice(name).get_dtype().startswith(("F", "BF"))

    def dtype(self, name: str) -> str:
        return self._handle(self.files[name]).get_slice(name).get_dtype()

    def get(self, name: str):
        if name not in self.files:
            raise CheckpointError(f"checkpoint in {self.folder!r} is missing tensor {name!r}")
        return self._handle(self.files[name]).get_tensor(name)

    def get_part(self, name: str, index: tuple):
        """``tensor[index]`` (a tuple of slices), reading only that part of the file:
        tensor parallelism's per-device slices (jspec/parallel/placement.py)."""
        if name not in self.files:
            raise CheckpointError(f"checkpoint in {self.folder!r} is missing tensor {name!r}")
        return self._handle(self.files[name]).get_slice(name)[index]

    def is_fp8(self, name: str) -> bool:
        """Is the tensor float8_e4m3fn (an FP8 weight)?"""
        return self.dtype(name) == "F8_E4M3"

    def get_fp8(self, name: str) -> np.ndarray:
        """A float8_e4m3fn tensor, mapped from the file (a numpy array of ml_dtypes' float8_e4m3fn;
        slicing it reads only that part)."""
        import ml_dtypes

        if name not in self.files:
            raise CheckpointError(f"checkpoint in {self.folder!r} is missing tensor {name!r}")
        fn = self.files[name]
        if fn not in self._headers:
            with open(fn, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                self._headers[fn] = (8 + n, json.loads(f.read(n)))
        start, header = self._headers[fn]
        info = header[name]
        if info["dtype"] != "F8_E4M3":
            raise CheckpointError(f"tensor {name!r} in {fn!r} is stored as {info['dtype']}, not F8_E4M3")
        a, b = info["data_offsets"]
        raw = np.memmap(fn, dtype=np.uint8, mode="r", offset=start + a, shape=(b - a,))
        return raw.view(ml_dtypes.float8_e4m3fn).reshape(info["shape"])

    def get_int(self, name: str):
        # framework="flax" would truncate int64 with a warning; numpy keeps it exact.
        with safe_open_checked(self.files[name], "np") as f:
            return f.get_tensor(name)

    def nbytes(self) -> int:
        return sum(os.path.getsize(fn) for fn in set(self.files.values()))

    def close(self):
        self._handles.clear()
        self._headers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

