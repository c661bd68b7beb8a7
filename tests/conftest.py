"""Shared fixtures, for every folder under tests/: the tiny HF checkpoints of
tests/helpers/targets.py, built once per session."""

from __future__ import annotations

import os

import pytest

from tests.helpers.targets import hf_checkpoint

os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpts")


@pytest.fixture(scope="session", params=["llama_tied", "llama_untied", "qwen3", "qwen3_moe"])
def target(request, ckpt_root):
    return (request.param,) + hf_checkpoint(ckpt_root, request.param)


@pytest.fixture(scope="session")
def llama_ckpt(ckpt_root):
    return hf_checkpoint(ckpt_root, "llama_tied")
