"""The training corpus: the Python standard library's own source files.

Every machine with Python has them offline, so the family can be rebuilt anywhere; the
corpus differs between Python versions, which is why the manifest records the version and
a hash of the (relative path, size) list. Files are split into train / held-out by a hash
of their relative path (not by position in the list), so adding or removing one file
never moves another across the split.

Token streams are numpy: every document is ``[bos] + tokens + [end_of_text]``, documents
are concatenated in file order and cut into fixed-length rows (the tail is dropped).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sysconfig

import numpy as np

# Path components that take a file out of the corpus: the test suites (test/, and the
# packages' own tests/, idle_test/), third-party code and caches.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
HELD_OUT_PERCENT = 5


@dataclasses.dataclass(frozen=True)
class Corpus:
    root: str
    files: tuple[str, ...]  # relative paths (posix separators), sorted
    sizes: tuple[int, ...]  # bytes, same order
    held_out_percent: int = HELD_OUT_PERCENT

    @property
    def train_files(self) -> tuple[str, ...]:
        return tuple(f for f in self.files if not is_held_out(f, self.held_out_percent))

    @property
    def held_out_files(self) -> tuple[str, ...]:
        return tuple(f for f in self.files if is_held_out(f, self.held_out_percent))

    def files_hash(self) -> str:
        """sha256 of the sorted 'relative path <TAB> size' lines: identifies the corpus."""
        h = hashlib.sha256()
        for f, s in zip(self.files, self.sizes):
            h.update(f"{f}\t{s}\n".encode())
        return h.hexdigest()

    def manifest(self) -> dict:
        return {
            "source": "python-stdlib",
            "python_version": platform.python_version(),
            "num_files": len(self.files),
            "num_bytes": int(sum(self.sizes)),
            "files_sha256": self.files_hash(),
            "held_out_percent": self.held_out_percent,
            "held_out_files": list(self.held_out_files),
        }

    def read(self, rel: str) -> str:
        with open(os.path.join(self.root, rel), encoding="utf-8", errors="replace") as f:
            return f.read()

    def texts(self, split: str) -> list[str]:
        """File contents of ``split`` ("train" | "held_out"), in file order."""
        files = {"train": self.train_files, "held_out": self.held_out_files}[split]
        return [self.read(f) for f in files]


def is_held_out(rel: str, percent: int = HELD_OUT_PERCENT) -> bool:
    digest = hashlib.sha256(rel.encode()).digest()
    return int.from_bytes(digest[:8], "little") % 100 < percent


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_corpus(root: str | None = None, max_files: int | None = None,
                  held_out_percent: int = HELD_OUT_PERCENT) -> Corpus:
    """The *.py files under the stdlib (or ``root``), minus EXCLUDED_DIRS, sorted.

    ``max_files`` keeps the first n of the sorted list (tests, quick runs); the manifest's
    hash then describes that subset.
    """
    root = root or stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for fn in filenames:
            if fn.endswith(".py"):
                full = os.path.join(dirpath, fn)
                found.append((os.path.relpath(full, root).replace(os.sep, "/"), os.path.getsize(full)))
    found.sort()
    if max_files is not None:
        found = found[:max_files]
    if not found:
        raise FileNotFoundError(f"no *.py files under {root!r}")
    return Corpus(root, tuple(f for f, _ in found), tuple(s for _, s in found), held_out_percent)


def token_stream(docs: list[list[int]], bos_id: int, eod_id: int) -> np.ndarray:
    """i32[N]: the documents' tokens, each as [bos] + doc + [eod], concatenated."""
    parts = []
    for d in docs:
        parts += [np.asarray([bos_id], np.int32), np.asarray(d, np.int32), np.asarray([eod_id], np.int32)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def pack(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """i32[n, seq_len]: the stream cut into rows (a partial last row is dropped)."""
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"a stream of {len(stream)} tokens is shorter than one row of {seq_len}")
    return stream[: n * seq_len].reshape(n, seq_len)


def batches(rows: np.ndarray, batch_size: int, seed: int):
    """Endless i32[batch_size, T] batches: each epoch visits every row once, shuffled."""
    rng = np.random.default_rng(seed)
    if len(rows) < batch_size:
        raise ValueError(f"{len(rows)} rows cannot fill a batch of {batch_size}")
    while True:
        order = rng.permutation(len(rows))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield rows[np.sort(order[i : i + batch_size])]


def save_manifest(corpus: Corpus, folder: str, **extra):
    with open(os.path.join(folder, "corpus.json"), "w") as f:
        json.dump({**corpus.manifest(), **extra}, f, indent=1)
