"""jspec/checkpoint/param_spec.py: targets and drafters go through one spec, check and load.

Each leaf must be its source tensors, read straight from the file, concatenated on axis 0
and reshaped (integer maps kept int32); a missing tensor or a wrong shape must fail naming
the tensor, through load_target and load_drafter alike.
"""

from __future__ import annotations

import os
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.checkpoint.param_spec import SpecList, check_specs, load_params
from jspec.checkpoint.safetensors_io import CheckpointError
from jspec.checkpoint.target import flat_params, load_target, target_param_spec
from jspec.checkpoint.tensor_sources import BinReader, open_tensor_source
from jspec.config import load_model_config
from jspec.drafters.config import drafter_config_from_hf
from jspec.drafters.loader import drafter_param_spec, load_drafter, read_drafter_config
from tests.helpers import spec_e2e as h

# "eagle3": a reduced draft vocabulary (integer d2t); "peagle": mask_hidden [1, 1, 3H] -> [3H].
CASES = ["target", "eagle3", "peagle"]


def _file_tensors(folder) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def _case(name):
    """(folder, specs, what the missing-tensor message calls the folder, loader)."""
    tfolder, _ = h.target()
    tcfg = load_model_config(tfolder)
    if name == "target":
        return tfolder, target_param_spec(tcfg), "checkpoint", lambda f: load_target(f)[1]
    folder = h.drafter(name)
    with open_tensor_source(folder) as src:
        dcfg = drafter_config_from_hf(read_drafter_config(folder), tcfg, frozenset(src.names()))
    return folder, drafter_param_spec(dcfg), "drafter checkpoint", lambda f: load_drafter(f, tcfg)[1]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_leaves_are_sources_concatenated_then_reshaped(name, dtype):
    folder, specs, what, _ = _case(name)
    tensors = _file_tensors(folder)
    with open_tensor_source(folder) as src:
        check_specs(src, specs, folder, what)
        params = flat_params(load_params(src, specs, dtype))
    assert len(params) == len(specs)
    assert any(len(s.sources) > 1 for s in specs)
    assert name != "eagle3" or any(s.integer for s in specs)
    assert name != "peagle" or any(s.shape != s.source_shapes[0] and len(s.sources) == 1 for s in specs)
    for s in specs:
        want = np.concatenate([tensors[n] for n in s.sources], axis=0).reshape(s.shape)
        got = params["/".join(s.path)]
        if s.integer:
            assert got.dtype == jnp.int32, s.path
            np.testing.assert_array_equal(np.asarray(got), want)
        else:
            assert got.dtype == dtype and got.shape == s.shape, s.path
            np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.asarray(want).astype(dtype)))


def test_spec_list_default_shape_and_explicit_reshape():
    folder, _ = h.target()
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    tensors = _file_tensors(folder)
    shapes = [tensors[q].shape, tensors[k].shape]
    specs = SpecList()
    specs.add(("cat",), [q, k], shapes)
    rows, cols = shapes[0][0] + shapes[1][0], shapes[0][1]
    specs.add(("flat",), [q, k], shapes, shape=(rows * cols,))
    assert specs[0].shape == (rows, cols) and specs[1].shape == (rows * cols,)
    with open_tensor_source(folder) as src:
        check_specs(src, specs, folder, "checkpoint")
        params = load_params(src, specs, jnp.float32)
    both = np.concatenate([tensors[q], tensors[k]])
    np.testing.assert_array_equal(np.asarray(params["cat"]), both)
    np.testing.assert_array_equal(np.asarray(params["flat"]), both.reshape(-1))


def _rewritten(folder, dst, fn) -> str:
    """A copy of ``folder`` with its tensors passed through ``fn``."""
    from safetensors.numpy import save_file

    shutil.copytree(folder, dst)
    tensors = _file_tensors(folder)
    fn(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("name", CASES)
def test_missing_tensor_is_named(name, tmp_path):
    folder, specs, what, load = _case(name)
    victim = next(s for s in specs if len(s.sources) > 1).sources[1]  # inside a concatenation
    bad = _rewritten(folder, tmp_path / "bad", lambda t: t.pop(victim))
    with pytest.raises(CheckpointError, match=f"^{re.escape(f'{what} {bad!r} is missing tensor {victim!r}')}$"):
        load(bad)


@pytest.mark.parametrize("name", CASES)
def test_wrong_shape_names_tensor_and_both_shapes(name, tmp_path):
    folder, specs, _, load = _case(name)
    spec = next(s for s in specs if len(s.source_shapes[0]) == 2)
    victim, want = spec.sources[0], list(spec.source_shapes[0])
    bad = _rewritten(folder, tmp_path / "bad", lambda t: t.__setitem__(victim, t[victim][:, :-1]))
    got = [want[0], want[1] - 1]
    msg = f"tensor {victim!r} in {bad!r} has shape {got}, expected {want} from config.json"
    with pytest.raises(CheckpointError, match=f"^{re.escape(msg)}$"):
        load(bad)


@pytest.mark.parametrize("name", CASES)
def test_a_weight_stored_as_integers_is_named(name, tmp_path):
    folder, specs, _, load = _case(name)
    victim = next(s for s in specs if not s.integer and len(s.shape) == 1).sources[0]  # a norm's weight
    bad = _rewritten(folder, tmp_path / "bad", lambda t: t.__setitem__(victim, t[victim].astype(np.int32)))
    msg = f"tensor {victim!r} in {bad!r} is stored as I32: expected a floating-point tensor"
    with pytest.raises(CheckpointError, match=f"^{re.escape(msg)}$"):
        load(bad)


def test_unused_tensors_are_named_in_a_warning(tmp_path, caplog):
    folder, _, what, load = _case("target")
    bad = _rewritten(folder, tmp_path / "extra", lambda t: t.update({"extra.weight": np.zeros(3, np.float32)}))
    with caplog.at_level("WARNING", logger="jspec.checkpoint"):
        load(bad)
    assert [r.getMessage() for r in caplog.records] == [f"{what} {bad!r}: 1 tensor(s) not used by jspec (extra.weight)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="jspec.checkpoint"):
        load(folder)
    assert not caplog.records  # a checkpoint as written: no warning


@pytest.mark.parametrize("size", ["empty", "truncated"])
def test_an_unreadable_safetensors_file_is_named(size, tmp_path):
    folder, _, _, load = _case("target")
    bad = shutil.copytree(folder, tmp_path / "bad")
    fn = os.path.join(bad, "model.safetensors")
    with open(fn, "rb") as f:
        data = f.read()
    with open(fn, "wb") as f:
        f.write(b"" if size == "empty" else data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"^{re.escape(fn)} is not a readable safetensors file"):
        load(str(bad))


def test_a_drafter_of_another_vocabulary_names_its_folder_and_both_sizes(tmp_path):
    import json

    tfolder, _ = h.target()
    tcfg = load_model_config(tfolder)
    bad = shutil.copytree(h.drafter("eagle3"), tmp_path / "drafter")
    cfg_path = os.path.join(bad, "config.json")
    with open(cfg_path) as f:
        d = json.load(f)
    d["transformer_layer_config"]["vocab_size"] = tcfg.vocab_size + 1
    with open(cfg_path, "w") as f:
        json.dump(d, f)
    with pytest.raises(ValueError, match=f"^drafter {re.escape(repr(str(bad)))}: .*{tcfg.vocab_size + 1}.*"
                                         f"vocab_size={tcfg.vocab_size}$"):
        load_drafter(str(bad), tcfg)


def test_target_from_pytorch_model_bin(tmp_path):
    import torch

    folder, _ = h.target()
    binned = tmp_path / "bin"
    os.makedirs(binned)
    shutil.copy(os.path.join(folder, "config.json"), binned / "config.json")
    torch.save({k: torch.from_numpy(v) for k, v in _file_tensors(folder).items()}, binned / "pytorch_model.bin")
    with open_tensor_source(str(binned)) as src:
        assert isinstance(src, BinReader)
    _, want = load_target(folder)
    _, got = load_target(str(binned))
    want, got = flat_params(want), flat_params(got)
    assert want.keys() == got.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
