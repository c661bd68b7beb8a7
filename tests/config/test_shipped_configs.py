"""configs/*.json: every shipped pair names a target, a drafter and a valid speculative_config."""

from __future__ import annotations

import glob
import json
import os

import pytest

from jspec.speculative_config import SpeculativeConfig

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "*.json")))


def test_there_are_configs_for_each_method():
    methods = {json.load(open(p))["speculative_config"]["method"] for p in CONFIGS}
    assert methods == {"eagle3", "peagle", "dflash"}


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_entry_is_valid(path):
    d = json.load(open(path))
    assert "/" in d["target"] and "/" in d["drafter"]
    spec = SpeculativeConfig.from_dict({**d["speculative_config"], "model": "/path/to/drafter"})
    assert spec.method == d["speculative_config"]["method"]
