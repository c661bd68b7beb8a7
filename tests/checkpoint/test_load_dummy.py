"""load_format="dummy" (vLLM's name): config.json alone, random weights, for target and drafters.

The benchmarks drive 8B shapes through jspec.LLM this way (no checkpoint on the GPU machine),
so the dummy tree must be exactly what the real loaders build (same paths, shapes, dtypes),
and an engine over it must run the same code: speculative greedy == plain greedy holds for
any weights, random ones included.
"""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
import pytest

import jspec
from jspec.checkpoint.target import load_target
from jspec.drafters import load_drafter
from tests.helpers import spec_e2e as h


def _config_only(src: str, dst: str) -> str:
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))
    return dst


def _shapes(tree):
    return {jax.tree_util.keystr(kp): (v.shape, str(v.dtype)) for kp, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dummy")
    target, _ = h.target()
    out = {"target": _config_only(target, str(root / "target"))}
    for name in ("eagle3", "peagle", "dflash4"):
        out[name] = _config_only(h.drafter(name), str(root / name))
    return out


def test_dummy_target_has_the_real_loaders_tree_and_plausible_values(folders):
    target, _ = h.target()
    cfg_real, real = load_target(target, "float32")
    cfg, params = load_target(folders["target"], "bfloat16", load_format="dummy")
    assert cfg == cfg_real
    assert {k: s for k, (s, _) in _shapes(params).items()} == {k: s for k, (s, _) in _shapes(real).items()}
    assert {d for _, d in _shapes(params).values()} == {"bfloat16"}
    w = np.asarray(params["layers_0"]["mlp"]["down_proj"]["weight"], np.float32)
    norm = np.asarray(params["layers_0"]["input_layernorm"]["weight"], np.float32)
    assert 0.015 < w.std() < 0.025 and abs(w.mean()) < 0.005  # N(0, 0.02)
    assert abs(norm.mean() - 1.0) < 0.05  # norm gains ~ 1
    # Deterministic: a second load draws the same weights.
    _, again = load_target(folders["target"], "bfloat16", load_format="dummy")
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)))


@pytest.mark.parametrize("name", ["eagle3", "peagle", "dflash4"])
def test_dummy_drafter_has_the_real_loaders_tree(folders, name):
    target, _ = h.target()
    tcfg, _ = load_target(target, "float32")
    cfg_real, real = load_drafter(h.drafter(name), tcfg, "float32")
    cfg, params = load_drafter(folders[name], tcfg, "float32", load_format="dummy")
    assert cfg == cfg_real
    assert _shapes(params) == _shapes(real)


def test_unknown_load_format_is_an_error_naming_it(folders):
    with pytest.raises(ValueError, match="load_format='safetensor'"):
        load_target(folders["target"], "float32", load_format="safetensor")


DUMMY_KW = dict(h.ENGINE_KW, dtype="float32", load_format="dummy", enable_prefix_caching=False)
DUMMY_PROMPTS = h.varied_prompts(3, 4, 30, seed=5)
GREEDY = jspec.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def dummy_plain(folders):
    """Greedy outputs of the plain engine over the dummy target (one engine for both drafters)."""
    return [o.token_ids for o in jspec.LLM(folders["target"], **DUMMY_KW).generate(DUMMY_PROMPTS, GREEDY)]


@pytest.mark.parametrize("name", ["eagle3", "dflash4"])
def test_speculative_greedy_equals_plain_on_dummy_weights(folders, dummy_plain, name):
    spec = jspec.LLM(folders["target"], speculative_config={"method": h.METHOD[name], "model": folders[name]},
                     **DUMMY_KW).generate(DUMMY_PROMPTS, GREEDY)
    assert [o.token_ids for o in spec] == dummy_plain
    assert sum(o.metrics.num_drafts for o in spec) > 0  # the drafter ran
