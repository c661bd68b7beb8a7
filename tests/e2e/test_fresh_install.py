"""What a new user gets from ``pip install -e ".[serve]"`` alone: chat through ``jspec.LLM``
and through the server, with none of the test extra's packages (torch and the rest bring
jinja2 along, which once hid that jspec needed it).

The fresh virtual environment holds exactly the distributions ``jspec[serve]`` requires,
transitively, as this environment resolved them: their files (each distribution's RECORD)
linked into the new environment's site-packages, and this checkout on its path as an
editable install puts it. No index is reached, so the test runs where CI runs.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import sysconfig
import tempfile

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers.serve import REPO, ServerProcess, free_port, jax_cache_env

CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]


def requirement_closure(name: str, extras: frozenset[str]) -> set[str]:
    """The installed distributions ``name[extras]`` needs, itself included (canonical names)."""
    seen: set[tuple[str, frozenset]] = set()
    todo = [(canonicalize_name(name), extras)]
    while todo:
        dist, ex = todo.pop()
        if (dist, ex) in seen:
            continue
        seen.add((dist, ex))
        for line in md.distribution(dist).requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ex | {""}):
                todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return {d for d, _ in seen}


def fresh_env(root: str, dists: set[str]) -> str:
    """A virtual environment at ``root`` holding ``dists`` (linked) and this checkout; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", root], check=True)
    site = subprocess.run([os.path.join(root, "bin", "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    here = sysconfig.get_path("purelib")
    for name in dists - {"jspec"}:
        dist = md.distribution(name)
        base = str(dist.locate_file(""))
        for f in dist.files or []:
            src = os.path.normpath(os.path.join(base, f))
            if not src.startswith(here + os.sep) or not os.path.exists(src):
                continue  # scripts and data outside site-packages
            dst = os.path.join(site, os.path.relpath(src, here))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if not os.path.lexists(dst):
                os.symlink(src, dst)
    with open(os.path.join(site, "jspec-checkout.pth"), "w") as f:  # as `pip install -e .` would
        f.write(REPO + "\n")
    return os.path.join(root, "bin", "python")


@pytest.fixture(scope="module")
def python():
    dists = requirement_closure("jspec", frozenset({"serve"}))
    assert "jinja2" in dists and "fastapi" in dists and "torch" not in dists, sorted(dists)
    with tempfile.TemporaryDirectory(prefix="jspec-fresh-") as root:
        yield fresh_env(root, dists)


def run(python: str, code: str) -> str:
    """``code`` in the fresh environment (isolated: no PYTHONPATH, not this directory)."""
    r = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, **jax_cache_env()), cwd=tempfile.gettempdir())
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout


def test_the_environment_lacks_the_test_extra(python):
    out = run(python, "import importlib.util as u; print([m for m in ('torch', 'pytest', 'jsonschema', 'openai') "
                      "if u.find_spec(m)])")
    assert out.strip() == "[]"


def test_chat_through_the_api(python):
    out = run(python, f"""
import jspec
llm = jspec.LLM(max_model_len=256, max_num_seqs=1)
o = llm.chat({CHAT!r}, jspec.SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
print(len(o.prompt_token_ids), len(o.outputs[0].token_ids))
""")
    n_prompt, n_out = map(int, out.split())
    assert n_prompt > 10 and n_out == 8


def test_chat_through_the_server(python):
    import openai

    port = free_port()
    fd, log = tempfile.mkstemp(prefix="jspec-fresh-serve-", suffix=".log")
    args = [python, "-I", "-m", "jspec.serve", "--port", str(port), "--max-model-len", "256", "--max-num-seqs", "1"]
    proc = subprocess.Popen(args, stdout=fd, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **jax_cache_env()))
    os.close(fd)
    srv = ServerProcess(args, port, proc, log)
    try:
        srv.wait_healthy()
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="-")
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
        assert r.choices[0].message.content and r.usage.completion_tokens == 8
    finally:
        assert srv.stop() == 0, srv.log()[-4000:]
