"""README.md's ``python`` blocks run as written, in order, on the embedded family: the
quickstart through ``jspec.LLM``, then the client block against a real ``python -m
jspec.serve`` (started with no model, as the README says; its address rewritten to a free
port). Blocks fenced as ``py`` are illustrations with paths to real models, not run."""

from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

from tests.helpers.serve import REPO, start_server

# The README as a user runs it: the engine's own shape buckets (folded ones: 46 -> 75 s in CI).
pytestmark = pytest.mark.production_buckets

ADDRESS = "127.0.0.1:8000"


def python_blocks() -> list[str]:
    with open(os.path.join(REPO, "README.md")) as f:
        return re.findall(r"^```python\n(.*?)^```$", f.read(), flags=re.S | re.M)


def test_the_readme_python_blocks_run_as_written():
    blocks = python_blocks()
    assert len(blocks) >= 2 and any(ADDRESS in b for b in blocks)
    ns: dict = {}
    srv = None
    try:
        for block in blocks:
            if ADDRESS in block:
                if srv is None:
                    srv = start_server(engine_args=["--max-num-seqs", "1"])
                block = block.replace(ADDRESS, srv.base_url.removeprefix("http://"))
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(block, "README.md", "exec"), ns)
            assert out.getvalue().strip(), block  # every block prints what it shows
    finally:
        if srv is not None:
            assert srv.stop() == 0, srv.log()[-4000:]
    # the quickstart's structured output: complete JSON, not cut at max_tokens
    assert ns["out"].outputs[0].finish_reason == "stop"
    assert ns["r"].choices[0].message.content
