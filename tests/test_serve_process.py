"""`txl serve` as a process: a session survives kill -9 (a request that changed it is durable when it
returns) and a restart; SIGTERM drains the request in flight, writes the sessions and exits 0; one access-log
line per request."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from serve_util import TEXT, make_model_dir  # noqa: E402

from txl.cli import main  # noqa: E402

pytestmark = pytest.mark.slow


def start(model_dir, state, log):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "txl", "serve", str(model_dir), "--port", "0",
                             "--serve.state_dir", str(state), "--serve.segment_len", "16",
                             "--serve.max_tokens", "4000", "--serve.threads", "1",
                             "--serve.drain_seconds", "120"],  # a loaded machine: the drain never cuts short
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env,  # noqa: SIM115
                            # SIGINT as a terminal delivers it (a shell without job control starts background
                            # jobs with SIGINT ignored)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text())
        if found:
            url = found.group(1)
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"txl serve did not start: {log.read_text()[-2000:]}")


def test_sessions_survive_kill_and_sigterm_drains(tmp_path):
    model_dir = make_model_dir(tmp_path / "model")
    doc, out = tmp_path / "doc.txt", tmp_path / "scores.jsonl"
    doc.write_text(TEXT, encoding="utf-8")
    assert main(["score", "--checkpoint", str(model_dir), str(doc), "-o", str(out), "--segment-len", "16"]) == 0
    expected = [json.loads(line)["logprob"] for line in out.read_text().splitlines() if '"logprob"' in line]
    state, log1, log2 = tmp_path / "state", tmp_path / "serve1.log", tmp_path / "serve2.log"

    proc, url = start(model_dir, state, log1)
    requests = 1  # the health check that found it ready
    try:
        c = httpx.Client(base_url=url, timeout=30)
        sid = c.post("/v1/sessions").json()["id"]
        gen = c.post("/v1/sessions").json()["id"]
        lps = []
        for piece in (TEXT[:50], TEXT[50:77], TEXT[77:100]):
            r = c.post(f"/v1/sessions/{sid}/text", json={"text": piece, "logprobs": True})
            lps += [t["logprob"] for t in r.json()["logprobs"] if t["logprob"] is not None]
        c.post(f"/v1/sessions/{gen}/text", json={"text": "The cat"})
        before = c.post(f"/v1/sessions/{gen}/generate", json={"max_tokens": 20, "seed": 1}).json()["session"]
        requests += 7
    finally:
        proc.send_signal(signal.SIGKILL)  # right after the last reply: nothing may be lost
        proc.wait(30)
    assert len(re.findall(r'"(GET|POST|DELETE) /', log1.read_text())) >= requests - 1

    proc, url = start(model_dir, state, log2)
    try:
        c = httpx.Client(base_url=url, timeout=30)
        again = c.get(f"/v1/sessions/{gen}").json()
        assert {k: again[k] for k in ("tokens_read", "tokens_generated", "nll")} == \
            {k: before[k] for k in ("tokens_read", "tokens_generated", "nll")}
        r = c.post(f"/v1/sessions/{sid}/text", json={"text": TEXT[100:], "final": True, "logprobs": True})
        lps += [t["logprob"] for t in r.json()["logprobs"] if t["logprob"] is not None]
        np.testing.assert_allclose(lps, expected, atol=1e-5, rtol=0)  # as if never interrupted

        drain(proc, c, gen, signal.SIGTERM, 20 + 300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log2.read_text()
    assert "sessions written" in text and "Traceback" not in text
    lines = re.findall(r'"(GET|POST|DELETE) (/\S*)" (\d+)', text)
    assert len(lines) == len([x for x in lines if x[1] != "/health"]) + text.count('"GET /health"')
    assert sum(1 for x in lines if x[1].endswith("/generate")) == 1  # one line per request, streams included


def drain(proc, c, sid, sig, generated):
    """``sig`` while a generation of 300 tokens streams on ``sid``: the stream completes, the process writes
    the sessions and exits 0; the session then holds ``generated`` tokens generated."""
    events = []

    def stream():
        with c.stream("POST", f"/v1/sessions/{sid}/generate", json={"max_tokens": 300, "stream": True}) as s:
            for line in s.iter_lines():
                if line:
                    events.append(line)

    reader = threading.Thread(target=stream)
    reader.start()
    for _ in range(1200):  # bounded: wait until the generation is under way (its first event came)
        if events:
            break
        time.sleep(0.05)
    proc.send_signal(sig)
    assert proc.wait(300) == 0
    reader.join(30)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["finish_reason"] == "length" and last["session"]["tokens_generated"] == generated


def test_sigint_drains_like_sigterm(tmp_path):
    """Ctrl-C (SIGINT) goes through the same drain: the stream completes, the session is written (a restart
    finds it), exit 0."""
    model_dir = make_model_dir(tmp_path / "model")
    state, log1, log2 = tmp_path / "state", tmp_path / "serve1.log", tmp_path / "serve2.log"
    proc, url = start(model_dir, state, log1)
    try:
        c = httpx.Client(base_url=url, timeout=30)
        sid = c.post("/v1/sessions").json()["id"]
        c.post(f"/v1/sessions/{sid}/text", json={"text": TEXT[:40]})
        drain(proc, c, sid, signal.SIGINT, 300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log1.read_text()
    assert "sessions written" in text and "Traceback" not in text and "KeyboardInterrupt" not in text
    proc, url = start(model_dir, state, log2)
    try:
        again = httpx.get(f"{url}/v1/sessions/{sid}", timeout=30).json()
        assert again["tokens_generated"] == 300 and again["tokens_read"] == 40 + 300
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
