"""`txl serve` on a full disk, a real one: a small tmpfs mounted as --serve.state_dir and filled. The request whose
state cannot be written answers 507 within seconds and the error is logged; the session stays usable and is
written once space returns; a failed eviction (durability 'shutdown') does not stop the model worker; a stopped
worker makes /health unhealthy. And the temporaries a killed server left in the state directory are removed at
start-up."""

import errno
import logging
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from serve_util import loader, make_model_dir, running  # noqa: E402

from txl.serve import ServeConfig, create_app  # noqa: E402
from txl.serve.session import SessionState, SessionStore  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("serve-disk") / "char")


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs: a real file system that fills (safetensors and Python see ENOSPC as they would on a disk)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True,
                              text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no mount command here: the full-disk tests need to mount a small tmpfs")
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def fill(directory):
    """Write a file until the file system is full; returns it (delete it to free the space)."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    block = b"\0" * 4096
    try:
        for _ in range(1 << 20):  # bounded: 4 GiB
            os.write(fd, block)
        raise AssertionError("the file system never filled")
    except OSError as err:
        assert err.errno == errno.ENOSPC, err
    finally:
        os.close(fd)
    return filler


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".tmp-"))


def test_a_full_disk_answers_507_and_the_session_goes_on_once_space_returns(model_dir, small_disk, caplog):
    caplog.set_level(logging.INFO, logger="txl.serve")
    app = create_app(ServeConfig(state_dir=str(small_disk), segment_len=16), loader(model_dir))  # 'request'
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        sid = c.post("/v1/sessions").json()["id"]
        assert c.post(f"/v1/sessions/{sid}/text", json={"text": "The cat sat."}).status_code == 200
        filler = fill(small_disk)
        start = time.monotonic()
        r = c.post(f"/v1/sessions/{sid}/text", json={"text": " More."}, timeout=10)  # not wedged: answered
        assert r.status_code == 507 and time.monotonic() - start < 10, r.text
        assert "could not be written" in r.json()["error"]["reason"] and str(small_disk) not in r.text
        assert any(rec.levelno == logging.ERROR and f"could not write session {sid}" in rec.getMessage()
                   and "No space left on device" in rec.getMessage() for rec in caplog.records)
        assert c.get("/health").json()["status"] == "ok"
        assert c.get(f"/v1/sessions/{sid}").json()["tokens_read"] == len("The cat sat. More.")  # kept in memory
        assert leftovers(small_disk) == []  # the failed write's temporary is gone

        filler.unlink()  # space returns: the session reads on and is written
        r = c.post(f"/v1/sessions/{sid}/text", json={"text": " Again."})
        assert r.status_code == 200 and r.json()["session"]["tokens_read"] == len("The cat sat. More. Again.")
        on_disk = SessionState.from_file(small_disk / f"{sid}.safetensors")
        assert on_disk.n_tokens == len("The cat sat. More. Again.")


def test_a_failed_eviction_keeps_the_worker_and_the_sessions(model_dir, small_disk, caplog):
    """durability 'shutdown': sessions beyond max_sessions_in_memory are written at eviction. On a full disk the
    eviction fails: logged once, the sessions stay in memory, every request is answered; once space returns the
    eviction is done and said."""
    caplog.set_level(logging.INFO, logger="txl.serve")
    app = create_app(ServeConfig(state_dir=str(small_disk), segment_len=16, durability="shutdown",
                                 max_sessions_in_memory=1), loader(model_dir))
    with running(app) as url, httpx.Client(base_url=url, timeout=10) as c:
        first = c.post("/v1/sessions").json()["id"]
        assert c.post(f"/v1/sessions/{first}/text", json={"text": "The cat sat."}).status_code == 200
        filler = fill(small_disk)
        second = c.post("/v1/sessions").json()["id"]  # over the budget: the first is to be written, and cannot
        for _ in range(3):  # the worker goes on (several eviction retries: 2 s apart)
            for sid in (first, second):
                assert c.post(f"/v1/sessions/{sid}/text", json={"text": " More."}).status_code == 200
            time.sleep(1)
        assert c.get("/health").json()["status"] == "ok"
        failed = [rec for rec in caplog.records if rec.levelno == logging.ERROR and "could not write session"
                  in rec.getMessage()]
        assert len(failed) == 1 and "No space left on device" in failed[0].getMessage()  # logged once, not per try
        assert leftovers(small_disk) == []

        filler.unlink()
        deadline = time.monotonic() + 30
        while not list(small_disk.glob("*.safetensors")):  # the next retry writes the least recently used one
            assert time.monotonic() < deadline, "the eviction was not done after space returned"
            time.sleep(0.1)
        assert any("can be written" in rec.getMessage() for rec in caplog.records)
        assert c.get(f"/v1/sessions/{first}").json()["tokens_read"] == len("The cat sat." + " More." * 3)
        assert c.get(f"/v1/sessions/{second}").json()["tokens_read"] == len(" More." * 3)


def test_health_reports_a_stopped_worker(model_dir, tmp_path, monkeypatch, caplog):
    """An error no request caused stops the worker (here injected into its eviction step): /health answers 503
    'failed' and model requests answer 503 at once instead of waiting for a worker that is gone."""
    app = create_app(ServeConfig(state_dir=str(tmp_path)), loader(model_dir))
    with running(app) as url, httpx.Client(base_url=url, timeout=10) as c:
        sid = c.post("/v1/sessions").json()["id"]

        def broken(self, pinned):
            raise RuntimeError("injected")

        monkeypatch.setattr(SessionStore, "evict", broken)
        r = c.post(f"/v1/sessions/{sid}/text", json={"text": "The cat"})  # in flight when the worker stops
        assert r.status_code == 503, r.text
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed", health.text
        assert "RuntimeError" in health.json()["reason"]
        r = c.post("/v1/completions", json={"prompt": "The", "max_tokens": 2})
        assert r.status_code == 503 and "worker stopped" in r.json()["error"]["reason"]
        monkeypatch.undo()  # the server's shutdown writes the sessions


KILLED_MID_WRITE = """
import sys, time
from pathlib import Path
from txl.fileio import atomic_write

def write(tmp):
    tmp.write_bytes(b"half a session")
    print("WRITING", flush=True)
    time.sleep(120)

atomic_write(Path(sys.argv[1]), write)
"""


def test_a_killed_servers_temporaries_are_removed_at_start(tmp_path):
    """A process killed (-9) in the middle of a session file's atomic write leaves `.tmp-ID.safetensors-PID-HEX`:
    removed when the state directory is opened again; one of a live process (another server writing now) is left
    to it, and a file that is not a session's temporary is not ours to remove."""
    sid = "A" * 32
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_WRITE, str(tmp_path / f"{sid}.safetensors")],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "WRITING"
    finally:
        proc.kill()
        proc.wait(30)
    [stale] = leftovers(tmp_path)
    assert stale.startswith(f".tmp-{sid}.safetensors-{proc.pid}-")
    live = tmp_path / f".tmp-{'B' * 32}.safetensors-{os.getpid()}-89abcdef"
    other = tmp_path / ".tmp-notes.txt"
    for p in (live, other):
        p.write_bytes(b"partial")
    store = SessionStore(tmp_path, max_in_memory=4, ttl=60)
    assert leftovers(tmp_path) == sorted([live.name, other.name])
    assert list(store.last_used) == []  # the killed write never published a session


def test_another_models_sessions_are_refused_with_409_and_left_intact(model_dir, tmp_path, caplog):
    """A state directory holding a char model's session, served with a word model: reading, generating, getting or
    deleting that session is a 409 naming the mismatch (not a 500 with tracebacks), the file is left as it was, and
    the char model serves it again afterwards."""
    word_dir = make_model_dir(tmp_path / "word", level="word")
    state = tmp_path / "state"

    def served(directory, **config):
        app = create_app(ServeConfig(state_dir=str(state), durability="request", **config), loader(directory))
        return running(app)

    with served(model_dir) as url, httpx.Client(base_url=url, timeout=60) as c:
        sid = c.post("/v1/sessions").json()["id"]
        assert c.post(f"/v1/sessions/{sid}/text", json={"text": "The cat sat on the mat."}).status_code == 200
        before = c.get(f"/v1/sessions/{sid}").json()
    written = (state / f"{sid}.safetensors").read_bytes()
    with caplog.at_level(logging.WARNING, "txl.serve"), served(word_dir, session_ttl=0.5) as url, httpx.Client(
            base_url=url, timeout=60) as c:
        for method, path, body in (("POST", "/text", {"text": "the cat"}), ("POST", "/generate", {"max_tokens": 2}),
                                   ("GET", "", None), ("DELETE", "", None)):
            r = c.request(method, f"/v1/sessions/{sid}{path}", json=body)
            assert r.status_code == 409, r.text
            error = r.json()["error"]
            assert error["field"] == "session" and "another model" in error["reason"]
            assert "vocab_size" in error["reason"]
        r = c.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 1, "session": sid})
        assert r.status_code == 409
        time.sleep(1.0)  # past the TTL: another model's session is not this server's to expire
        assert c.get("/health").status_code == 200
    assert "Traceback" not in caplog.text and "1 sessions in" in caplog.text
    assert (state / f"{sid}.safetensors").read_bytes() == written
    with served(model_dir) as url, httpx.Client(base_url=url, timeout=60) as c:
        assert c.get(f"/v1/sessions/{sid}").json()["tokens_read"] == before["tokens_read"]


def test_a_session_written_before_fingerprints_is_judged_by_what_it_holds(tmp_path):
    """A file without the model's fingerprint: refused when its memory's layers or width or its token ids do not
    fit the model, read (and then fingerprinted) when they do."""
    from txl.serve.session import model_mismatch

    here = {"vocab_size": 6, "n_layer": 2, "d_model": 8, "architecture": "a", "tokenizer": "t"}
    assert model_mismatch({"tokens": [1, 5]}, {"memory": [2, 3, 8]}, here) is None
    assert "token id 122" in model_mismatch({"tokens": [1, 122]}, {"memory": [2, 3, 8]}, here)
    assert "3 layers of width 8" in model_mismatch({"tokens": []}, {"memory": [3, 3, 8]}, here)
    assert "width 16" in model_mismatch({"tokens": []}, {"compressed": [2, 1, 16]}, here)
    assert model_mismatch({"model": {**here, "architecture": "b"}}, {}, here) == "architecture b there, a here"
    assert model_mismatch({"model": dict(here)}, {}, here) is None

    import torch

    ok, bad = SessionState(id="o" * 32, tokens=[1, 2]), SessionState(id="b" * 32, tokens=[1, 122])
    ok.memory = bad.memory = torch.zeros(2, 3, 8)
    for s in (ok, bad):
        s.to_file(tmp_path / f"{s.id}.safetensors")
    store = SessionStore(tmp_path, max_in_memory=4, ttl=60, model=here)
    assert set(store.foreign) == {bad.id} and set(store.last_used) == {ok.id}
    assert store.get(ok.id, "").model == here
    with pytest.raises(Exception) as err:
        store.get(bad.id, "")
    assert err.value.status == 409 and "token id 122" in err.value.reason
