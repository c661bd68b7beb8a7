"""Greedy acceptance of the trained drafters on held-out stdlib files, measured by jspec.

Prompts are the first ``prompt_tokens`` tokens of held-out documents (``<|begin_of_text|>``
included) long enough for the prompt plus ``max_tokens``; the target continues each
greedily with and without speculation. Reported per method, from the engine's own
counters: mean acceptance length (1 + accepted / drafts), the per-position acceptance
rates, tokens/s, and whether the speculative outputs equal the plain ones.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from jspec.engine.sequence import spec_stats_delta
from jspec.train import tokenizer


def held_out_prompts(stream: np.ndarray, bos_id: int, n: int, prompt_tokens: int, max_tokens: int) -> list[list[int]]:
    """Up to ``n`` prompts: the first ``prompt_tokens`` tokens of each long enough document."""
    starts = np.flatnonzero(stream == bos_id)
    ends = np.append(starts[1:], len(stream))
    out = [stream[s : s + prompt_tokens].tolist() for s, e in zip(starts, ends) if e - s >= prompt_tokens + max_tokens]
    return out[:n]


def measure(out: str, methods=("eagle3", "peagle", "dflash"), *, num_prompts: int = 32, prompt_tokens: int = 128,
            max_tokens: int = 128, dtype: str = "float32", max_num_seqs: int = 8, log=print) -> dict:
    """The accept stage: held-out prompts of a training run's folder; writes OUT/acceptance.json."""
    tdir = os.path.join(out, "target")
    stream = np.load(os.path.join(out, "tokenizer", "tokens_held_out.npy"))
    bos = tokenizer.special_ids(tokenizer.load_tokenizer(tdir))[tokenizer.BOS]
    prompts = held_out_prompts(stream, bos, num_prompts, prompt_tokens, max_tokens)
    if not prompts:
        raise ValueError(f"no held-out document has {prompt_tokens + max_tokens} tokens")
    drafters = {m: os.path.join(out, m) for m in methods if os.path.isdir(os.path.join(out, m))}
    result = measure_prompts(tdir, drafters, prompts, max_tokens=max_tokens, dtype=dtype,
                             max_num_seqs=max_num_seqs, log=log)
    result["prompt_tokens"] = prompt_tokens
    with open(os.path.join(out, "acceptance.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def measure_prompts(target_dir: str, drafters: dict[str, str], prompts: list[list[int]], *, max_tokens: int,
                    dtype: str = "float32", max_num_seqs: int = 8, num_speculative_tokens: dict | None = None,
                    log=print) -> dict:
    """Greedy plain and speculative runs of `prompts` (token ids) on the target, one per
    drafter folder ({method: folder}); counters from the engine, tok/s after compilation.
    ``num_speculative_tokens`` ({method: K}): K where not the checkpoint's default."""
    import jspec

    sp = jspec.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    kw = {"dtype": dtype, "max_num_seqs": max_num_seqs,
          "max_model_len": max(len(p) for p in prompts) + max_tokens + 32}
    result = {"prompts": len(prompts), "max_tokens": max_tokens, "dtype": dtype}

    def run(llm):
        llm.generate(prompts[:1], sp, use_tqdm=False)  # compile outside the timing
        t0 = time.perf_counter()
        outs = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        return outs, len(prompts) * max_tokens / (time.perf_counter() - t0)

    plain, tps = run(jspec.LLM(target_dir, **kw))
    result["plain_tokens_per_s"] = tps
    for m, folder in drafters.items():
        k = (num_speculative_tokens or {}).get(m)
        spec = {"method": m, "model": folder, **({"num_speculative_tokens": k} if k else {})}
        llm = jspec.LLM(target_dir, speculative_config=spec, **kw)
        before = llm.engine.stats()
        outs, tps = run(llm)
        d = spec_stats_delta(before, llm.engine.stats())
        drafts = max(d["num_drafts"], 1)
        result[m] = {
            "num_speculative_tokens": llm.engine.spec.num_speculative_tokens,
            "mean_acceptance_length": 1 + d["num_accepted_tokens"] / drafts,
            "acceptance_per_position": [a / drafts for a in d["accepted_per_position"]],
            "tokens_per_s": tps,
            "matches_plain": sum(o == p for o, p in zip(outs, plain)) / len(plain),
        }
        r = result[m]
        log(f"[accept] {m} K={r['num_speculative_tokens']}: acceptance length {r['mean_acceptance_length']:.3f}, "
            f"per position {[round(x, 3) for x in r['acceptance_per_position']]}, "
            f"{tps:.0f} tok/s (plain {result['plain_tokens_per_s']:.0f}), same as plain {r['matches_plain']:.0%}")
    return result
