"""Shared pieces of the `txl serve` tests: a tiny model directory with its tokenizer, and a real uvicorn
server on 127.0.0.1 (a free port) in a thread of the test process, stopped by the context manager."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_config

import txl
from txl.data.sources import Source
from txl.data.tokenizer import fit_tokenizer, make_spec, save_tokenizer

TEXT = ("The cat sat on the mat. A dog ran to the red house; it was big.\n"
        "Café, naïve, 日本語 and 😀 are here too: 0123456789 (x + y) * z = ?!\n") * 3


def make_model_dir(directory: Path, *, level: str = "char", spec: dict | None = None, **overrides) -> Path:
    """A random tiny model (memory 8) and a tokenizer fitted on TEXT (``spec``: options of its level), saved as
    `txl generate` reads them."""
    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    spec = make_spec(level, **spec) if spec else make_spec("char", unk="<unk>") if level == "char" else make_spec(level)
    tok = fit_tokenizer(spec, [Source(corpus)])
    corpus.unlink()
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny_config(vocab_size=tok.vocab_size, mem_len=8, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    txl.save_pretrained(model, directory)
    save_tokenizer(tok, directory)
    return directory


def loader(directory: Path):
    """The ``load`` of create_app for a model directory (as `txl serve DIR` loads it)."""
    from txl.data.tokenizer import load_model_tokenizer

    def load():
        model = txl.from_pretrained(directory)
        return model, load_model_tokenizer(directory, vocab_size=model.config.vocab_size), "tiny"

    return load


@contextlib.contextmanager
def running(app, *, timeout: float = 120.0, ready: bool = True):
    """Serve ``app`` with uvicorn on 127.0.0.1 at a free port; yields the base URL once /health is ok
    (``ready=False``: once it accepts connections, the model perhaps still loading)."""
    import httpx
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by connections: no 40 ms delayed ACKs
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=5, log_config=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == (200 if ready else 503) or (
                        not ready and server.started):
                    break
            except httpx.TransportError:
                pass
            if not thread.is_alive():
                raise RuntimeError("the server stopped before it was ready")
            if time.monotonic() > deadline:  # generous: a loaded 2-core machine loads the model slowly
                raise RuntimeError(f"the server was not ready within {timeout:.0f} s")
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


@contextlib.contextmanager
def served_client(model_dir: Path, state_dir: Path, **config):
    """An httpx client of ``model_dir`` served at a free port (``ServeConfig(**config)``; durability 'shutdown'
    and batches of 4 unless given), the server stopped on exit."""
    import httpx

    from txl.serve import ServeConfig, create_app

    app = create_app(ServeConfig(state_dir=str(state_dir), **{"durability": "shutdown", "max_batch": 4, **config}),
                     loader(model_dir))
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def word_model_fixtures(name: str):
    """A test module's module-scoped fixtures ``word_dir`` (a word-level model directory) and ``api`` (a client of
    a server on it, ``served_client``), their temporary directories named after ``name``:
    ``word_dir, api = word_model_fixtures("openai")`` at the module's top."""

    @pytest.fixture(scope="module")
    def word_dir(tmp_path_factory):
        return make_model_dir(tmp_path_factory.mktemp(name) / "word", level="word")

    @pytest.fixture(scope="module")
    def api(word_dir, tmp_path_factory):
        with served_client(word_dir, tmp_path_factory.mktemp(f"{name}-state")) as client:
            yield client

    return word_dir, api


def txl_score_logprobs(model_dir: Path, directory: Path, segment_len: int) -> np.ndarray:
    """`txl score`'s per-token log-probs of TEXT (the command's JSONL, 6 decimals), read in segments of segment_len."""
    from txl.cli import main

    doc, out = directory / "doc.txt", directory / "scores.jsonl"
    doc.write_bytes(TEXT.encode("utf-8"))
    assert main(["score", "--checkpoint", str(model_dir), str(doc), "-o", str(out), "--segment-len",
                 str(segment_len)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return np.array([r["logprob"] for r in rows if "logprob" in r])
