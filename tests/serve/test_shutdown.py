"""Graceful shutdown of ``python -m jspec.serve``: SIGTERM with streams in flight lets them
end cleanly (finished, or aborted after --shutdown-timeout, always ending with [DONE]), refuses
new work, and exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.helpers.serve import start_server


def test_sigterm_drains_in_flight_streams_and_exits_0():
    # grace 0.3 s: the 2-token streams finish in it, the 230-token ones (well over 0.3 s of
    # decoding) are aborted when it ends
    srv = start_server(["--shutdown-timeout", "0.3", "--max-model-len", "256"])
    try:
        results, first = [], threading.Barrier(5)

        def stream(i, max_tokens):
            body = {"prompt": f"Shutdown {i}", "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            events = []
            with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        if len(events) == 1:
                            first.wait(30)
            results.append((max_tokens, r.status_code, events))

        threads = [threading.Thread(target=stream, args=(i, mt)) for i, mt in enumerate([2, 2, 230, 230])]
        for t in threads:
            t.start()
        first.wait(60)  # every stream has its first event
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # no new work once draining: refused (503) or connection refused
            r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
        except httpx.TransportError:
            pass
        for t in threads:
            t.join(60)
        rc = srv.proc.wait(60)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert rc == 0, srv.log()[-3000:]
    assert len(results) == 4
    reasons = {}
    for max_tokens, status, events in results:
        assert status == 200 and events[-1] == "data: [DONE]", events[-3:]
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        reasons.setdefault(max_tokens, []).append(chunks[-1]["choices"][0]["finish_reason"])
    assert reasons[2] == ["length", "length"], reasons  # short ones finish normally
    assert reasons[230] == ["abort", "abort"], reasons  # long ones end cleanly when the grace period is over
    assert "Application shutdown complete" in srv.log()
