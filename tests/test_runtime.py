"""Process settings (txl.runtime) and the optimiser choice."""

import platform
from pathlib import Path

import pytest
import torch

from txl.config import OptimConfig
from txl.optim import build_optimizer
from txl.runtime import cpu_has_native_bf16, retain_freed_memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_retain_freed_memory_is_accepted_by_glibc():
    assert retain_freed_memory() is True
    assert retain_freed_memory() is True  # idempotent


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="needs /proc/cpuinfo")
def test_native_bf16_matches_the_cpu_flags():
    flags = Path("/proc/cpuinfo").read_text(errors="replace")
    assert cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


def test_fused_adam_where_torch_has_it_else_the_plain_one(monkeypatch):
    model = torch.nn.Linear(4, 3)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    assert optimizer.defaults["fused"] is True
    original = torch.optim.Adam

    def no_fused(params, fused=None, **kw):
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        return original(params, **kw)

    monkeypatch.setattr(torch.optim, "Adam", no_fused)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    assert not optimizer.defaults["fused"]
    assert len(optimizer.param_groups[0]["params"]) == 2


def test_auto_precision_is_bf16_only_on_a_gpu_that_supports_it(monkeypatch):
    from txl.runtime import resolve_precision

    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("fp16", torch.device("cpu")) == "fp16"  # explicit choices pass through
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision("auto", torch.device("cuda")) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_precision("auto", torch.device("cuda")) == "fp32"


def test_tf32_is_set_for_the_block_only_and_never_on_cpu():
    from txl.runtime import matmul_precision

    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with matmul_precision(torch.device("cuda"), tf32=True):
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
    with pytest.raises(RuntimeError, match="boom"), matmul_precision(torch.device("cuda"), tf32=True):
        raise RuntimeError("boom")
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
    with matmul_precision(torch.device("cpu"), tf32=True):
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def test_compile_off_is_the_model_itself_and_host_tensors_stay_on_cpu():
    from txl.runtime import compile_model, to_device

    model = torch.nn.Linear(2, 2)
    assert compile_model(model, False) is model
    t = torch.arange(4)
    assert to_device(t, None) is t and to_device(t, "cpu") is t


def test_thread_count_given_then_environment_then_one(monkeypatch):
    import txl.runtime as rt

    assert rt.choose_threads(3) == (3, "--threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert rt.choose_threads(None) == (2, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert rt.choose_threads(None)[0] == 1  # whatever the machine: the same figures per CPU kind


def test_oversubscribed_threads_are_detected_with_advice(monkeypatch):
    """Two threads while another process holds one of two cores: the collapse is named before the run."""
    import txl.runtime as rt

    monkeypatch.setattr(rt.os, "cpu_count", lambda: 2)
    for busy, threads, advice in ((1.0, 2, "use --threads 1"), (0.2, 2, None), (2.0, 1, None), (None, 2, None)):
        monkeypatch.setattr(rt, "busy_cpus", lambda busy=busy: busy)
        got = rt.oversubscribed(threads)
        assert (got is None) if advice is None else got.endswith(advice), (busy, threads, got)
    monkeypatch.setattr(rt, "busy_cpus", lambda: 1.0)
    assert rt.oversubscribed(2).startswith("2 CPU threads but only 1.0 cores are idle (1.0 busy with other work)")


def test_busy_cpus_reads_proc_stat():
    import txl.runtime as rt

    busy = rt.busy_cpus(0.05)
    if Path("/proc/stat").is_file():
        assert busy is not None and 0.0 <= busy <= (__import__("os").cpu_count() or 1) + 1e-9
    else:
        assert busy is None


def test_every_command_takes_threads_and_run_json_records_the_machine(corpus, tmp_path, capsys):
    from txl.cli import build_parser, main

    for name, command in build_parser()._subparsers._group_actions[0].choices.items():
        assert "--threads" in command._option_string_actions, name
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--data.corpus", corpus, "--max-steps", "1", "--threads", "1",
                 "--out", str(out), "--train.sample_tokens", "0", "--train.eval_interval", "0",
                 "--no-progress"]) == 0
    assert torch.get_num_threads() == 1
    machine = __import__("json").loads((out / "run.json").read_text())["machine"]
    assert machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and machine["threads"] == 1
    assert machine["torch"] == torch.__version__ and machine["python"] == platform.python_version()
    printed = capsys.readouterr().out
    assert f"CPU kernels {machine['cpu_capability']}, 1 thread(s), torch {torch.__version__}" in printed
    with pytest.raises(SystemExit) as stop:  # argparse: the usage line, then the error
        main(["eval", str(out), "--threads", "0"])
    assert stop.value.code == 2
    assert "txl eval: error: argument --threads: --threads '0' must be a whole number >= 1" in capsys.readouterr().err


ENGINE_THREADS = """
import os, sys, threading
sys.path.insert(0, sys.argv[1])
import torch
from serve_util import loader, make_model_dir
from txl.serve.engine import Engine, Job, Model
from txl.serve.session import SessionStore

torch.set_num_threads(1)  # what the command line does (--threads, else OMP_NUM_THREADS, else 1)
model, tokenizer, _ = loader(make_model_dir(__import__("pathlib").Path(sys.argv[2]) / "m"))()
engine = Engine(Model(model, segment_len=8, mem_len=8, same_length=False, clamp_len=-1), tokenizer,
                SessionStore(sys.argv[2], max_in_memory=2, ttl=60), max_queue=4, max_batch=4, durable=False)
before = len(os.listdir("/proc/self/task"))
engine.start()
done = threading.Event()
result = {}

def work(state, job):  # runs on the worker thread: a matmul and a reduction large enough to split across threads
    a = torch.randn(1000, 1000)
    (a @ a).exp().sum()
    return len(os.listdir("/proc/self/task"))

engine.submit(Job(session=None, owner="", work=work, emit=lambda kind, data: (result.update({kind: data}),
                                                                              done.set())))
done.wait(60)
print(before, result["done"])
"""


@pytest.mark.slow  # a subprocess
def test_the_serve_worker_thread_computes_with_the_commands_thread_count(tmp_path):
    """OpenMP's thread count is per thread, a new thread starting from OMP_NUM_THREADS (else every core): the serve
    worker sets the command's count, so a server started without OMP_NUM_THREADS computes as one started with
    OMP_NUM_THREADS=1 (one thread: the worker alone is added to the process, no OpenMP team)."""
    import os
    import subprocess
    import sys

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: every thread's OpenMP default is one thread already")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    tests = str(Path(__file__).parent)
    out = subprocess.run([sys.executable, "-c", ENGINE_THREADS, tests, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    before, during = map(int, out.stdout.split())
    assert during == before + 1, f"{before} threads before the worker started, {during} while it computed"
