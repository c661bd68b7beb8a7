"""Start the real server (``python -m jspec.serve``) in a subprocess for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from tests.helpers.default_model import default_model_path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Small engine: few shape buckets to compile on CPU, yet room for real batching.
# The tiny random model (tests/helpers/default_model.py), not jspec.LLM's default (the trained family):
# the server tests are about the serving machinery, and the tiny model compiles and runs fastest.
TINY_MODEL = default_model_path()
ENGINE_ARGS = ["--model", TINY_MODEL, "--max-num-seqs", "16", "--max-model-len", "128", "--page-size", "16"]
ENGINE_KWARGS = dict(model=TINY_MODEL, max_num_seqs=16, max_model_len=128, page_size=16)  # the same, for jspec.LLM


def jax_cache_env() -> dict:
    """Share compiled executables between the test process and server subprocesses (and
    across runs): most of a CPU server test's time is XLA compilation."""
    from tests.helpers.default_model import cache_dir

    return {"JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR")
            or os.path.join(cache_dir(), "jax-cache-tests"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], port: int, proc: subprocess.Popen, log_path: str):
        self.args, self.port, self.proc, self.log_path = args, port, proc, log_path
        self.base_url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}\n{self.log()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"server not healthy after {timeout}s\n{self.log()[-4000:]}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"server did not exit within {timeout}s of {sig!r}\n{self.log()[-4000:]}") from None


def start_server(extra_args: list[str] = (), model: str | None = None, timeout: float = 180.0,
                 wait: bool = True, engine_args: list[str] = tuple(ENGINE_ARGS)) -> ServerProcess:
    """``python -m jspec.serve`` on a free loopback port; waits for /health unless wait=False
    (then call ``srv.wait_healthy()``)."""
    port = free_port()
    args = [sys.executable, "-m", "jspec.serve", "--port", str(port), *engine_args, *extra_args]
    if model is not None:
        args += ["--model", model]
    fd, log_path = tempfile.mkstemp(prefix="jspec-serve-", suffix=".log")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **jax_cache_env())
    proc = subprocess.Popen(args, cwd=REPO, stdout=fd, stderr=subprocess.STDOUT, env=env)
    os.close(fd)
    srv = ServerProcess(args, port, proc, log_path)
    if wait:
        srv.wait_healthy(timeout)
    return srv


def metric_samples(text: str) -> dict:
    """{(sample name, frozenset(labels without model_name)): value} from /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def metric(text_or_samples, name: str, **labels) -> float:
    samples = metric_samples(text_or_samples) if isinstance(text_or_samples, str) else text_or_samples
    return samples.get((name, frozenset(labels.items())), 0.0)
