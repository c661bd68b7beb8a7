"""The drafters' training rows: the target's own greedy continuations of corpus prompts.

A drafter serves the target's outputs, not the corpus: at inference its context is what
the target wrote (after a short prompt, greedy text of its own, loops included), and a
drafter distilled only over corpus rows first meets that text when it is served. EAGLE3
and DFlash drafters are commonly trained on target-generated trajectories (as the
Draft-OPD paper, arXiv 2605.29343, describes the practice), and so are this family's: each
row is a prompt cut from the train stream, then the target's greedy continuation from
jspec's engine, a training row's length (``seq_len``) in all. The drafter stages read
these rows with ``--drafter-data generated``; the target's logits over them stay the
distillation target, so what changes is the context the drafter learns in. (On the CPU,
300 steps of the shipped DFlash over 512 such rows raised its acceptance length on
``python -m jspec``'s prompts from 2.37 to 2.86, where 300 steps over corpus rows gave
2.30.)

Prompts: ``prompt_min`` .. ``prompt_max`` tokens, half of them the start of a document
(``<|begin_of_text|>`` first, as a user's prompt and the accept stage's are), half at a
random offset; every choice comes from the seed, so a run is reproducible. A row keeps its
prompt: anchors there train on corpus text, and the row spans every position a corpus row
does. The rows decoded together (a wave of ``max_num_seqs``) share one prompt length, so a
wave starts, decodes (``num_scheduler_steps`` tokens per call) and ends together: rows of
mixed lengths end one by one, and each new prompt admitted in their place costs a prefill
step (the first try, 8192 rows of mixed lengths at 512 at a time, had not finished after
five minutes on an H200).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    rows: int = 8192
    prompt_min: int = 8
    prompt_max: int = 256
    max_num_seqs: int = 512  # rows decoded together (a wave)
    num_scheduler_steps: int = 16  # tokens per decode call
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.prompt_min <= self.prompt_max:
            raise ValueError(f"generate: need 1 <= prompt_min ({self.prompt_min}) <= prompt_max ({self.prompt_max})")
        if self.rows < 1 or self.max_num_seqs < 1:
            raise ValueError(f"generate: rows ({self.rows}) and max_num_seqs ({self.max_num_seqs}) must be >= 1")


def prompts_from_stream(stream: np.ndarray, bos_id: int, gc: GenerateConfig) -> list[list[int]]:
    """``gc.rows`` prompts cut from the token stream: lengths uniform in
    [prompt_min, prompt_max], one per wave of ``max_num_seqs`` rows; even rows start at a
    document's ``bos_id``, odd rows anywhere."""
    rng = np.random.default_rng(gc.seed)
    waves = -(-gc.rows // gc.max_num_seqs)
    lengths = np.repeat(rng.integers(gc.prompt_min, gc.prompt_max + 1, waves), gc.max_num_seqs)[: gc.rows]
    if len(stream) <= gc.prompt_max:
        raise ValueError(f"generate: a stream of {len(stream)} tokens is too short for {gc.prompt_max}-token prompts")
    doc_starts = np.flatnonzero(stream[: len(stream) - gc.prompt_max] == bos_id)
    anywhere = rng.integers(0, len(stream) - gc.prompt_max, gc.rows)
    starts = np.where(np.arange(gc.rows) % 2 == 0,
                      doc_starts[rng.integers(0, len(doc_starts), gc.rows)] if len(doc_starts) else anywhere, anywhere)
    return [stream[s : s + n].tolist() for s, n in zip(starts, lengths)]


def continue_greedily(target_dir: str, prompts: list[list[int]], length: int, gc: GenerateConfig, *,
                      dtype: str = "float32", log=print, save=None) -> np.ndarray:
    """i32[len(prompts), length]: each prompt followed by the target's greedy tokens
    (end-of-text ignored), from jspec.LLM over ``target_dir`` (float32: as the family is
    served by default). ``save(rows done so far)`` after each wave: a run cut short keeps
    its finished waves."""
    import jspec

    if max(map(len, prompts)) >= length:
        raise ValueError(f"generate: a prompt of {max(map(len, prompts))} tokens leaves no room in rows of {length}")
    page_size = 16
    pages_per_row = -(-length // page_size) + 1
    llm = jspec.LLM(target_dir, dtype=dtype, max_num_seqs=gc.max_num_seqs, max_model_len=length + page_size,
                    page_size=page_size, num_gpu_blocks_override=gc.max_num_seqs * pages_per_row,
                    num_scheduler_steps=gc.num_scheduler_steps, enable_prefix_caching=False,
                    generation_config="vllm", seed=gc.seed)
    rows = np.zeros((len(prompts), length), np.int32)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), gc.max_num_seqs):  # one wave per call
        part = prompts[i : i + gc.max_num_seqs]
        sps = [jspec.SamplingParams(temperature=0, max_tokens=length - len(p), ignore_eos=True) for p in part]
        for j, (p, o) in enumerate(zip(part, llm.generate(part, sps, use_tqdm=False))):
            rows[i + j] = p + list(o.token_ids)
        done = i + len(part)
        if save is not None:
            save(rows[:done])
        log(f"[generate] {done}/{len(prompts)} rows, {done * length / (time.perf_counter() - t0):,.0f} tok/s")
    del llm  # its KV pool goes back to the device before a drafter stage trains in this process
    return rows
