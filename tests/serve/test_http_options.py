"""The HTTP server as vLLM's flags set it up: CORS (every origin by default), several
--served-model-name names, /version and /ping, --disable-fastapi-docs, and the command line
that carries them (TLS files and --root-path go to uvicorn)."""

from __future__ import annotations

import pytest

import jspec
from jspec.serve import cli
from jspec.serve.app import HTTPOptions, create_app
from tests.helpers.serve import ENGINE_KWARGS

ORIGIN = "https://ui.example"


@pytest.fixture(scope="module")
def engine():
    return jspec.LLM(**ENGINE_KWARGS).engine


def client(engine, **kw):
    from starlette.testclient import TestClient

    return TestClient(create_app(engine, **kw))


def test_cors_preflight_is_answered_before_the_api_key(engine):
    with client(engine, api_key="k", http=HTTPOptions(allowed_origins=[ORIGIN])) as c:
        pre = c.options("/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                                         "Access-Control-Request-Headers": "authorization"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        # a browser sees the 401 (it carries the CORS headers) ...
        r = c.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
        # ... and another origin gets no CORS header
        other = c.get("/v1/models", headers={"Origin": "https://elsewhere.example", "Authorization": "Bearer k"})
        assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    with client(engine) as c:  # vLLM's default: every origin
        r = c.get("/health", headers={"Origin": "https://any.example"})
        assert r.headers["access-control-allow-origin"] == "*"


def test_served_model_names_version_ping_docs(engine):
    with client(engine, served_model_name=["first", "alias"]) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["first", "alias"]
        r = c.post("/v1/completions", json={"model": "alias", "prompt": "a b", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "first"  # responses name the first (vLLM's)
        bad = c.post("/v1/completions", json={"model": "other", "prompt": "a", "max_tokens": 1})
        assert bad.status_code == 404 and bad.json()["error"]["param"] == "model"
        assert c.get("/v1/models/alias").json()["id"] == "alias"
        assert c.get("/version").json() == {"version": jspec.__version__}
        assert c.get("/ping").json() == {"status": "ok"} and c.post("/ping").status_code == 200
        assert c.get("/openapi.json").status_code == 200
    with client(engine, http=HTTPOptions(docs=False)) as c:
        assert c.get("/openapi.json").status_code == 404 and c.get("/docs").status_code == 404


def test_command_line_carries_the_http_flags():
    args = cli.build_parser().parse_args(
        ["m", "--served-model-name", "a", "b", "--allowed-origins", f'["{ORIGIN}"]', "--allowed-methods",
         '["GET", "POST"]', "--allow-credentials", "--root-path", "/api", "--disable-fastapi-docs",
         "--ssl-keyfile", "key.pem", "--ssl-certfile", "cert.pem", "--ssl-cert-reqs", "2", "--max-log-len", "100"])
    assert args.served_model_name == ["a", "b"]
    assert cli.http_options(args) == HTTPOptions(allowed_origins=[ORIGIN], allowed_methods=["GET", "POST"],
                                                 allowed_headers=["*"], allow_credentials=True, docs=False)
    assert (args.ssl_keyfile, args.ssl_certfile, args.ssl_cert_reqs, args.root_path) == \
        ("key.pem", "cert.pem", 2, "/api")
    default = cli.http_options(cli.build_parser().parse_args(["m"]))
    assert default == HTTPOptions()
