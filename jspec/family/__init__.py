"""jspec's own model family: a ~10M-parameter Llama target and its EAGLE3, PEagle and DFlash
drafters, trained by ``jspec.train`` on the Python standard library (docs/training.md holds
the commands, losses and corpus hash), shipped in the package so speculation can be seen
working, with real acceptance, on any machine and without a download.

The folders are ordinary checkpoints (a HF Llama folder; speculators-format drafters) and
load through the ordinary paths. ``jspec.LLM()`` serves the target; a speculative_config
with a method and no "model" takes the family's drafter for that method (``drafter_for``).
"""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(ROOT, "jspec-stdlib-10m")
METHODS = ("eagle3", "peagle", "dflash")
# The longest acceptance of the three on held-out files over its block (3.08 at K = 7), and
# at its default K = 4 a CPU speedup above 1 (docs/training.md).
DEFAULT_METHOD = "dflash"


def is_target(model: str | os.PathLike | None) -> bool:
    """Whether `model` is the family's target folder (None is: it is jspec.LLM's default)."""
    if model is None:
        return True
    return os.path.isdir(model) and os.path.samefile(model, TARGET)


def drafter_for(model: str | os.PathLike | None, method: str) -> str:
    """The family drafter folder for `method`, when `model` is the family's target; else a
    ValueError naming what to pass instead."""
    if method not in METHODS:
        raise ValueError(f"speculative_config 'method' {method!r} has no drafter in jspec's model family "
                         f"(it has {', '.join(METHODS)}); pass 'model' with the drafter checkpoint path")
    if not is_target(model):
        raise ValueError(f"speculative_config has method {method!r} and no 'model': the drafter checkpoint path is "
                         f"required unless the target is jspec's embedded model family ({TARGET}), and the target "
                         f"here is {model}")
    return os.path.join(ROOT, method)
