"""Shared by the `txl serve` benchmarks: a model directory to serve and a `txl serve` process on 127.0.0.1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

SHAKESPEARE = Path(__file__).resolve().parents[1] / "../shared/data/tinyshakespeare/input.txt"


def corpus_text(limit: int = 400_000) -> str:
    """Text to read: Tiny Shakespeare when the shared data is there, else a generated one."""
    for path in (SHAKESPEARE, Path("/work/shared/data/tinyshakespeare/input.txt")):
        if path.is_file():
            return path.read_text(encoding="utf-8")[:limit]
    return "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(limit // 50))


def make_model_dir(directory: Path, *, n_layer: int = 4, d_model: int = 256, mem_len: int = 128) -> Path:
    """A random character-level model (the 'small' shape of benchmarks.generation, memory 128) and its
    tokenizer fitted on the corpus: weights do not change the cost of a forward pass."""
    import torch

    import txl
    from txl.data.sources import Source
    from txl.data.tokenizer import fit_tokenizer, make_spec, save_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    text = directory / "corpus.txt"
    text.write_text(corpus_text(), encoding="utf-8")
    tok = fit_tokenizer(make_spec("char", unk="<unk>"), [Source(text)])
    text.unlink()
    torch.manual_seed(0)
    config = txl.ModelConfig(vocab_size=tok.vocab_size, n_layer=n_layer, d_model=d_model, n_head=4,
                             d_head=d_model // 4, d_inner=4 * d_model, mem_len=mem_len, dropout=0.0)
    txl.save_pretrained(txl.TransformerXL(config), directory)
    save_tokenizer(tok, directory)
    return directory


def start_server(model_dir: Path, log: Path, *options: str, timeout: float = 120,
                 package: str = "txl") -> tuple[subprocess.Popen, str]:
    """`txl serve MODEL_DIR --port 0 OPTIONS` in a process of its own; (process, base URL) once /health is ok.

    ``package``: the package run as ``python -m PACKAGE serve`` (an older tree's copy, e.g. ``txl_old``, found on
    ``sys.path``, to compare with)."""
    import httpx

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-m", package, "serve", str(model_dir), "--port", "0", *options],
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env)  # noqa: SIM115
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text())
        if found:
            try:
                if httpx.get(found.group(1) + "/health", timeout=2).status_code == 200:
                    return proc, found.group(1)
            except httpx.TransportError:
                pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"txl serve did not start; its log:\n{log.read_text()[-3000:]}")


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")
