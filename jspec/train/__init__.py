"""jspec.train: trains jspec's own small model family on the Python standard library.

``python -m jspec.train --stage all --out DIR`` (see docs/training.md) runs the stages of
``pipeline``: a byte-level BPE tokenizer (``tokenizer``) over the stdlib corpus
(``corpus``), a Llama target (``target``), then EAGLE3 / PEagle (``eagle3``) and DFlash
(``dflash``) drafters distilled from the frozen target's hidden states and logits
(``drafters``). Training runs in JAX with optax (``loop``) on GPU, TPU or CPU, through
dense forwards (``layers``) over the very parameter trees jspec serves; outputs are a HF
Llama folder and speculators-format drafter folders, loaded by the ordinary checkpoint
paths.
"""

from jspec.train.pipeline import STAGES, RunConfig, run

__all__ = ["STAGES", "RunConfig", "run"]
