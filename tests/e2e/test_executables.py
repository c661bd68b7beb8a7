"""Whole step executables kept on disk (jspec/engine/executables.py): a second process with
the same code, model and configuration loads every step program warmup needs instead of
tracing and compiling it, and its outputs are the first process's."""

import json
import os
import subprocess
import sys

_PROBE = r"""
import json, sys
import jspec
spec = json.loads(sys.argv[2])
llm = jspec.LLM(sys.argv[1], max_model_len=64, num_pages=32, max_num_seqs=1, dtype="float32", warmup=True,
                speculative_config=spec)
r = llm.engine.runner
warm = r.num_compilations
sp = jspec.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
outs = llm.generate([[1, 2, 3, 1, 2], [5, 6, 7, 8]], sp, use_tqdm=False)
print(json.dumps({"traced_in_warmup": warm, "loaded": r.num_loaded, "traced_after": r.num_compilations - warm,
                  "programs": len(r._executables), "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def _run(tmp_path, spec=None, **env):
    from tests.helpers.serve import TINY_MODEL

    base = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    base.update({"JSPEC_CACHE": str(tmp_path / "jc"), **env})
    r = subprocess.run([sys.executable, "-c", _PROBE, TINY_MODEL, json.dumps(spec)], env=base, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_a_second_process_loads_every_step_program(tmp_path):
    """The first process traces and compiles each program warmup needs and keeps it; the
    second traces none (nothing after warmup either) and generates the same tokens; another
    configuration (a drafter) loads nothing of the first's, then its own; damaged files are
    compiled again, with a warning."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    root = tmp_path / "jc" / "executables"

    def kept():  # one environment folder: this code's
        (folder,) = os.listdir(root)
        return sorted((root / folder).iterdir())

    first, _ = _run(tmp_path)
    n_first = len(kept())  # XLA:CPU cannot serialize the top-k / top-p variants: compiled each time
    assert first["traced_in_warmup"] == first["programs"] > n_first > 0 and first["loaded"] == 0
    second, _ = _run(tmp_path)
    assert second["loaded"] == n_first and second["traced_in_warmup"] == first["programs"] - n_first
    assert second["traced_after"] == first["traced_after"] == 0 and second["tokens"] == first["tokens"]
    spec, _ = _run(tmp_path, ngram)
    n_spec = len(kept()) - n_first
    assert spec["loaded"] == 0 and spec["traced_in_warmup"] == spec["programs"] > n_spec > 0
    spec2, _ = _run(tmp_path, ngram)
    assert spec2["loaded"] == n_spec and spec2["tokens"] == spec["tokens"] == first["tokens"]
    for f in kept():
        f.write_bytes(f.read_bytes()[:100])
    damaged, err = _run(tmp_path, ngram)
    assert damaged["loaded"] == 0 and damaged["tokens"] == spec["tokens"] and "could not be loaded" in err
