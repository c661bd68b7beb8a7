"""Issue 2: checkpoint formats (single, sharded, orbax) and clear errors for bad ones."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.checkpoint.safetensors_io import CheckpointError
from jspec.checkpoint.target import flat_params, load_target, save_orbax
from jspec.config import ConfigError
from jspec.drafters.loader import read_drafter_config
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.transformer import Transformer


def logits_of(folder, ids, dtype="float32"):
    cfg, params = load_target(folder, dtype)
    kv = KVCache.create(cfg.num_layers, 8, 8, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    meta = AttentionMetadata.for_single_sequence(list(range(8)), 8, 0, len(ids), 8)
    m = Transformer(cfg)
    h, _, _ = m.apply({"params": params}, jnp.asarray([ids]), meta, kv)
    return np.asarray(m.apply({"params": params}, h, method=Transformer.logits))


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_sharded_checkpoint_gives_same_logits(llama_ckpt, tmp_path):
    folder, hf = llama_ckpt
    sharded = str(tmp_path / "sharded")
    hf.save_pretrained(sharded, max_shard_size="50KB")
    files = os.listdir(sharded)
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 2
    ids = list(range(5, 30))
    np.testing.assert_array_equal(logits_of(folder, ids), logits_of(sharded, ids))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_round_trip_is_bit_identical(llama_ckpt, tmp_path, dtype):
    folder, _ = llama_ckpt
    _, params = load_target(folder, dtype)
    copy = copy_ckpt(folder, tmp_path / "orbax_copy")
    save_orbax(params, copy)
    os.remove(os.path.join(copy, "model.safetensors"))  # the restore must not touch it
    _, restored = load_target(copy, dtype)
    a, b = flat_params(params), flat_params(restored)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == jnp.dtype(dtype), k
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k
        assert b[k].sharding.device_set == {jax.devices()[0]}


def test_orbax_restores_into_other_dtype(llama_ckpt, tmp_path):
    folder, _ = llama_ckpt
    _, params = load_target(folder, "float32")
    copy = copy_ckpt(folder, tmp_path / "orbax_bf16")
    save_orbax(params, copy)
    _, restored = load_target(copy, "bfloat16")
    for k, v in flat_params(restored).items():
        assert v.dtype == jnp.bfloat16, k
        np.testing.assert_array_equal(np.asarray(v), np.asarray(flat_params(params)[k].astype(jnp.bfloat16)))


def _rewrite_tensors(folder, fn):
    from safetensors.numpy import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_is_named(llama_ckpt, tmp_path):
    bad = copy_ckpt(llama_ckpt[0], tmp_path / "missing")
    _rewrite_tensors(bad, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_target(bad)


def test_wrong_shape_names_tensor_and_both_shapes(llama_ckpt, tmp_path):
    bad = copy_ckpt(llama_ckpt[0], tmp_path / "shape")
    _rewrite_tensors(bad, lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.weight", np.zeros((64, 32), np.float32)))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight'.*\[64, 32\].*\[64, 64\]"):
        load_target(bad)


def _edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        d = json.load(f)
    d.update(changes)
    with open(path, "w") as f:
        json.dump(d, f)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported"),
        ({"model_type": "mixtral"}, "model_type 'mixtral' is not supported"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}}, "rope_type=.longrope."),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"sliding_window_pattern": 4}, r"unsupported key\(s\) \['sliding_window_pattern'\]"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ],
)
def test_bad_config_is_named(llama_ckpt, tmp_path, changes, match):
    bad = copy_ckpt(llama_ckpt[0], tmp_path / "cfg")
    _edit_config(bad, **changes)
    with pytest.raises(ConfigError, match=match):
        load_target(bad)


def test_bad_paths_and_dtype(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_target(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_target(str(tmp_path))
    os.makedirs(tmp_path / "empty")
    with open(tmp_path / "empty" / "config.json", "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8,
                   "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}, f)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_target(str(tmp_path / "empty"))
    index = tmp_path / "empty" / "model.safetensors.index.json"
    index.write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not valid JSON"):
        load_target(str(tmp_path / "empty"))
    index.write_text("[]")
    with pytest.raises(CheckpointError, match=r"index\.json: a JSON object expected, got list"):
        load_target(str(tmp_path / "empty"))
    index.write_text('{"weight_map": []}')
    with pytest.raises(CheckpointError, match="no 'weight_map' object"):
        load_target(str(tmp_path / "empty"))
    index.unlink()
    with pytest.raises(ValueError, match="dtype='int8' is not supported"):
        load_target(str(tmp_path / "empty"), "int8")


@pytest.mark.parametrize("content, match", [
    (b'{"model_type": "llama",', "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b'["LlamaForCausalLM"]', "a JSON object expected, got list"),
])
def test_a_malformed_config_json_is_named(tmp_path, content, match):
    """Target and drafter configs alike: a ConfigError naming the file, not json's or an
    AttributeError from the translation."""
    (tmp_path / "config.json").write_bytes(content)
    for load in (load_target, read_drafter_config):
        with pytest.raises(ConfigError, match=rf"config\.json: {match}"):
            load(str(tmp_path))
