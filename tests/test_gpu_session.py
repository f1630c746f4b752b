"""The prepared GPU session (benchmarks.gpu_session): its steps keep to their limits and the budget, what they
measured survives a step cut off, and the plan holds the issue's checks. Run here on a CPU; the figures
themselves come from a lent GPU."""

import importlib.metadata
import json
import sys
import time
from pathlib import Path

import pytest
from conftest import ORACLE_VERSION, oracle_absent

from benchmarks import gpu_session as gs
from benchmarks import switches

PY = sys.executable


def step(name, code, cap=30.0, least=0.0, **kw):
    return gs.Step(name, f"{name} check", (PY, "-c", code), cap, least, **kw)


def gone(pid: int, wait: float = 5.0) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie not yet reaped), waiting up to ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_step_over_its_limit_is_stopped_and_keeps_its_output(tmp_path):
    """A step past its cap is killed with what it started; what it printed stays in session.log and summary.md,
    the next steps still run, and one that no longer fits the budget is listed as not run, with why."""
    pid_file = tmp_path / "child.pid"
    steps = [step("slow", "import subprocess, sys, time\n"
                          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                          f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
                          "print('measured 42 tokens/s', flush=True); time.sleep(60)", cap=2.0),
             step("fine", "print('| table | row |')"),
             step("big", "print('never')", least=10_000),
             step("absent", "print('never')", needs=("no_such_module_here",))]
    done = gs.run_session(steps, tmp_path, budget=60)
    outcomes = {name: outcome for name, outcome, _ in done}
    assert outcomes["slow"] == "stopped at its limit (2 s)" and outcomes["fine"] == "ok"
    assert outcomes["big"].startswith("not run:") and "it needs 10000" in outcomes["big"]
    assert outcomes["absent"] == "not run: no_such_module_here not installed"
    log = (tmp_path / "session.log").read_text()
    assert "measured 42 tokens/s" in log and "===== slow: stopped at its limit" in log and "never" not in log
    summary = (tmp_path / "summary.md").read_text()
    assert "| slow | stopped at its limit (2 s) |" in summary and "measured 42 tokens/s" in summary
    assert "| table | row |" in summary
    assert gone(int(pid_file.read_text())), "the step's child outlived the step"


def test_a_step_is_asked_to_stop_first_so_the_sessions_it_started_end_too(tmp_path):
    """benchmarks.run starts each worker in a session of its own, out of reach of a kill of the step's session:
    the step gets SIGTERM first (benchmarks.run then kills its worker), and SIGKILL only after."""
    pid_file = tmp_path / "worker.pid"
    code = ("import os, signal, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "signal.signal(signal.SIGTERM, lambda *_: (os.killpg(child.pid, signal.SIGKILL), sys.exit(143)))\n"
            "print('working', flush=True); time.sleep(60)")
    done = gs.run_session([step("nested", code, cap=2.0)], tmp_path, budget=60)
    assert done[0][1] == "stopped at its limit (2 s)"
    assert gone(int(pid_file.read_text())), "the worker in a session of its own outlived the step"


def test_a_benchmark_step_cut_off_keeps_the_rows_it_wrote(tmp_path):
    """benchmarks.run rewrites results.jsonl after every measurement; the session merges whatever is there, each
    row tagged with its step, and copies the step's files to --out."""
    bench = tmp_path / "bench"
    bench.mkdir()
    code = (f"import json, time\nopen({str(bench / 'results.jsonl')!r}, 'w').write(json.dumps({{'kind': 'eval', "
            f"'tokens_per_s': 5.0}}) + '\\n')\nopen({str(bench / 'speedup.md')!r}, 'w').write('| L |')\n"
            "time.sleep(60)")
    out = tmp_path / "out"
    out.mkdir()
    done = gs.run_session([step("bench", code, cap=3.0, bench=str(bench), files=(str(bench / "speedup.md"),))],
                          out, budget=60)
    assert done[0][1] == "stopped at its limit (3 s); 1 benchmark rows"
    assert [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()] == \
        [{"step": "bench", "kind": "eval", "tokens_per_s": 5.0}]
    assert (out / "speedup.md").read_text() == "| L |"


def test_the_plan_holds_the_issues_checks_in_order(tmp_path):
    """On a GPU: every -m gpu test first, then NVIDIA's shape in bf16 eager and through CUDA graphs (each profiled
    once), the same with issue 34's changes switched back, serving, base at GPU size; issue 26's remaining checks
    after. Issue 34's first steps fit one 9-minute command."""
    steps = gs.plan("cuda", tmp_path)
    names = [s.name for s in steps]
    assert names[:7] == ["env", "bench-46", "gpu-tests", "bench-eager", "bench-graphs", "bench-before",
                         "serve-engine"]
    assert names[-8:] == ["bench-big", "flex", "speedup", "parallel-one", "serve-compiled", "bench-reference",
                          "serve-http", "suite"]
    by = {s.name: " ".join(s.argv) for s in steps}
    assert "benchmarks.flex --device cuda" in by["flex"]
    assert names[7] == "serve-captured" and "--captured --at-end --shapes small wt103 --compile" in by["serve-captured"]
    assert names[8] == "launches" and "benchmarks.launches --device cuda" in by["launches"]
    assert "-m gpu --continue-on-collection-errors tests" in by["gpu-tests"]
    for name in ("bench-46", "bench-eager", "bench-graphs", "bench-before"):
        assert "--shapes nvidia --dtypes bf16 --phases train eval" in by[name]
        assert "--device cuda" in by[name] and "--keep-going" in by[name]
    assert "--modes eager --profile" in by["bench-eager"] and "--modes graphs --profile" in by["bench-graphs"]
    assert "--before " + " ".join(switches.available()) in by["bench-before"]
    ways = "--modes eager compiled graphs step step-eager --profile"
    assert ways in by["bench-46"] and "--shapes base-gpu" in by["bench-big"] and ways in by["bench-big"]
    assert "--lengths 800,1800,2800,3800" in by["speedup"] and "--reps 10" in by["speedup"]
    assert "--compute.attn_impl reference" in by["bench-reference"] and "--device cuda" in by["serve-engine"]
    assert "benchmarks.parallel_one --device cuda" in by["parallel-one"]
    assert "benchmarks.serve_step --device cuda" in by["serve-compiled"] and "--compile" in by["serve-compiled"]
    first = [s for s in steps if s.name in ("env", "bench-46", "gpu-tests", "bench-eager", "bench-graphs",
                                            "bench-before")]
    assert sum(s.cap_s for s in first) <= 540 + 420 + 420, "the caps of one call's steps stay near its budget"
    assert sum(s.min_s for s in first) < 530, "one 9-minute call reaches issue 34's A/B"
    oracle = gs.plan("cuda", tmp_path, oracle_site="/tmp/site")
    assert [s.name for s in oracle][3] == "oracle-cuda" and oracle[3].env["PYTHONPATH"].startswith("/tmp/site")
    base = gs.plan("cuda", tmp_path, baseline_src="/tmp/old/src")
    step = next(s for s in base if s.name == "bench-baseline")
    assert step.env["PYTHONPATH"].split(":")[0] == "/tmp/old/src" and "--modes eager" in " ".join(step.argv)
    smoke = {s.name: " ".join(s.argv) for s in gs.plan("cpu", tmp_path, smoke=True)}
    assert "--graphs-backend aot_eager" in smoke["bench-graphs"] and "--shapes tiny" in smoke["bench-graphs"]


def test_the_targets_table_reads_issue_34s_targets_and_each_ab():
    """targets.md: the faster of eager and graphs against the tokens/s floors, a profiled step's host against
    device time, graphs against eager per shape, the -m gpu tests, and each before-row against the plain one."""
    def row(step, kind, tokens, graphs=False, **more):
        return dict(step=step, shape="nvidia", dtype="bf16", kind=kind, tokens_per_s=tokens, mfu=0.1,
                    mfu_vs_bf16_peak=0.2, graphs=graphs, **more)
    def profile(host, device):  # a profiler table's total lines (the verdict reads the profiler's own totals)
        return f"...\nSelf CPU time total: {host}\nSelf CUDA time total: {device}\n"
    rows = [row("bench-eager", "train", 100_000, profile=profile("120.000ms", "40.000ms")),
            row("bench-eager", "eval", 50_000),
            row("bench-graphs", "train", 250_000, graphs=True, profile=profile("2.000ms", "30.000ms")),
            row("bench-graphs", "eval", 40_000, graphs=True, profile_error="CUPTI said no"),
            row("bench-before", "train", 80_000, before=["sdpa-pin"]),
            row("bench-baseline", "eval", 25_000)]
    done = [("gpu-tests", "failed (exit status 1); 1 failed, 22 passed", 40.0)]
    text = gs.targets(rows, done)
    assert "| nvidia train bf16 >= 200,000 tokens/s | 250,000 (graphs; MFU 0.200) | met |" in text
    assert "| nvidia eval bf16 >= 400,000 tokens/s | 50,000 (eager; MFU 0.200) | missed |" in text
    assert "| host < device time per step: nvidia train bf16 eager | host 120.0 ms, device 40.0 ms | missed |" in text
    assert "| host < device time per step: nvidia train bf16 graphs | host 2.0 ms, device 30.0 ms | met |" in text
    assert "| host < device time per step: nvidia eval bf16 graphs | the profile failed: CUPTI said no | - |" in text
    assert "| graphs >= eager: nvidia bf16 train | 2.50x (250,000 against 100,000) | met |" in text
    assert "| graphs >= eager: nvidia bf16 eval | 0.80x (40,000 against 50,000) | missed |" in text
    assert "| every -m gpu test passing | failed (exit status 1); 1 failed, 22 passed | missed |" in text
    assert "| nvidia train bf16 eager | sdpa-pin switched back | 80,000 | 100,000 | 1.25x |" in text
    assert "| nvidia eval bf16 eager | the earlier tree | 25,000 | 50,000 | 2.00x |" in text
    issue46 = [dict(row("bench-46", "train", 210_000, warmup_steps=5, warmup_s=61.5), captured="compiled"),
               dict(row("bench-46", "train", 150_000), captured="eager kernels"),
               dict(row("bench-big", "eval", 1_600_000, graphs=True), shape="base-gpu")]
    text = gs.targets(rows[:4] + issue46, done)
    assert "| step >= eager: nvidia bf16 train | 2.10x (210,000 against 100,000) | met |" in text
    assert "| base-gpu eval bf16 >= 1,500,000 tokens/s | 1,600,000 (graphs) | met |" in text
    assert "| nvidia train bf16 step | 5 | 61.5 |" in text  # compilation and capture, apart
    assert ("| nvidia train bf16 | the captured step's model through inductor, against eager kernels | 150,000 | "
            "210,000 | 1.40x |") in text
    empty = gs.targets([], [("gpu-tests", "ok; 23 skipped", 9.0)])
    assert "| nvidia train bf16 >= 200,000 tokens/s | not measured | - |" in empty
    assert "| every -m gpu test passing | ok; 23 skipped | not measured (none ran here) |" in empty


def test_host_and_device_time_are_the_profilers_totals_each_kernel_once():
    """The H200's graphed eval step at e3c225e (tests/golden: its row as results.jsonl recorded it): the row's
    profile_device_ms (13.1 ms) added the launching ops' and the compiled graph's range to the kernels; the
    profiler's own total is 6.5 ms, below the host's 8.2 ms: the target is missed, not met. A profile without its
    totals gives no verdict."""
    row = json.loads((Path(__file__).parent / "golden" / "h200_graphs_eval_profile.json").read_text())
    assert row["profile_device_ms"] > 13  # the recorded figure, counted twice
    assert gs.profile_totals(row["profile"]) == (8.229, 6.539)
    text = gs.targets([row], [])
    assert "| host < device time per step: nvidia eval bf16 graphs | host 8.2 ms, device 6.5 ms | missed |" in text
    assert gs.profile_totals("Self CPU time total: 950.5us\nSelf CUDA time total: 1.2s") == (0.9505, 1200.0)
    unreadable = gs.targets([dict(row, profile="a table cut short")], [])
    assert ("| host < device time per step: nvidia eval bf16 graphs | not measured (the profile has no host or "
            "device total) | - |") in unreadable and "| met |" not in unreadable


def test_a_profiles_device_time_counts_each_kernel_once():
    """benchmarks.instruments.device_time_us: the device's events only, as the profiler's total line counts them."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks.instruments import device_time_us

    def event(device, us, annotation=False):
        return SimpleNamespace(device_type=device, self_device_time_total=us, is_user_annotation=annotation)
    events = [event(DeviceType.CPU, 1136.0),  # aten::copy_: its Memcpy's time again
              event(DeviceType.CUDA, 1136.0),  # the Memcpy
              event(DeviceType.CUDA, 5398.0, annotation=True),  # "## Call CompiledFxGraph": the kernels inside it
              event(DeviceType.CUDA, 1021.0)]  # a kernel
    assert device_time_us(events) == 1136.0 + 1021.0


def test_pytest_counts_are_read_from_a_steps_output():
    assert gs.pytest_counts("...F\n==== 1 failed, 18 passed, 3 skipped in 37.09s ====\n") == \
        "1 failed, 18 passed, 3 skipped"
    assert gs.pytest_counts("5 passed in 1.20s\n") == "5 passed" and gs.pytest_counts("no tests") == ""


@pytest.mark.slow  # real subprocesses: the env step and one tiny measurement, on this CPU
def test_smoke_session_on_a_cpu(tmp_path, capsys):
    rc = gs.main(["--smoke", "--only", "env,bench-eager", "--out", str(tmp_path), "--budget", "200"])
    assert rc == 0
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["device"] == "cpu" and env["txl_from"].endswith("src/txl")
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted((r["step"], r["kind"], r["shape"]) for r in rows) == \
        [("bench-eager", "eval", "tiny"), ("bench-eager", "train", "tiny")]
    assert "| bench-eager | ok; 2 benchmark rows |" in capsys.readouterr().out


@pytest.mark.slow  # real subprocesses: torch.compile (aot_eager) and an earlier tree's import, on this CPU
def test_smoke_graphs_and_an_earlier_tree_on_a_cpu(tmp_path, capsys):
    """The graphs step (aot_eager here), profiled, and --baseline-src: its rows come from the txl in that
    directory (a copy of this one here); targets.md is written and printed."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(Path(gs.ROOT) / "src" / "txl", old / "txl", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    rc = gs.main(["--smoke", "--only", "bench-graphs,bench-baseline", "--out", str(out), "--budget", "400",
                  "--baseline-src", str(old)])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["step"], r["kind"], r["graphs"]) for r in rows) == [
        ("bench-baseline", "eval", False), ("bench-baseline", "train", False),
        ("bench-graphs", "eval", True), ("bench-graphs", "train", True)]
    assert {r["txl_from"] for r in rows if r["step"] == "bench-baseline"} == {str(old / "txl")}
    assert {r["txl_from"] for r in rows if r["step"] == "bench-graphs"} == {str(Path(gs.ROOT) / "src" / "txl")}
    assert all(r["profile_host_ms"] > 0 for r in rows if r["step"] == "bench-graphs")
    targets = (out / "targets.md").read_text()
    assert "## Issue 34's targets" in targets and targets in capsys.readouterr().out


def test_bad_arguments_are_refused_in_one_line(tmp_path, capsys):
    for argv, message in ((["--list", "--skip", "bench"], "--skip bench: no step bench; the steps are env, "),
                          (["--smoke"], "--out DIR is needed"),
                          (["--smoke", "--out", str(tmp_path), "--budget", "0"], "--budget 0: give a positive"),
                          (["--smoke", "--out", str(tmp_path), "--baseline-src", str(tmp_path)],
                           f"--baseline-src {tmp_path}: no txl package there")):
        with pytest.raises(SystemExit):
            gs.main(argv)
        assert message in capsys.readouterr().err


def test_another_transformers_than_the_oracle_skips_the_oracle_tests(monkeypatch):
    """A GPU image ships transformers 5 (no TransfoXL): the oracle tests skip there, naming what is installed,
    instead of failing on an import."""
    def version(name, real=importlib.metadata.version):
        return "5.17.0" if name == "transformers" else real(name)
    monkeypatch.setattr(importlib.metadata, "version", version)
    assert oracle_absent() == "is not installed here (transformers 5.17.0 is)"
    monkeypatch.setattr(importlib.metadata, "version", lambda name: ORACLE_VERSION)
    assert oracle_absent() is None


def test_verdicts_read_the_steps_side_by_side_against_the_targets():
    """summary.md's 'Against the targets': eager tokens/s, MFU of the bf16 peak and GPU memory, compiled / eager and
    fused / reference from their own steps, each of the issue's targets met or missed, failed measurements named."""
    def row(step, shape, kind, tokens, mfu, mem):
        return dict(step=step, shape=shape, dtype="bf16", kind=kind, tokens_per_s=tokens, mfu=mfu / 2,
                    mfu_vs_bf16_peak=mfu, peak_mem_mb=mem)
    rows = [row("bench-eager", "nvidia", "train", 250_000, 0.25, 30_000),
            row("bench-eager", "nvidia", "eval", 300_000, 0.2, 8_000),
            row("bench-compiled", "nvidia", "train", 300_000, 0.3, 28_000),
            row("bench-reference", "nvidia", "train", 200_000, 0.2, 40_000),
            row("bench-reference", "nvidia", "eval", 310_000, 0.2, 7_000),
            dict(step="bench-compiled", kind="failed", shape="nvidia", dtype="bf16", phase="eval",
                 failure="over --worker-timeout 200 s", error="")]
    text = gs.verdicts(rows)
    assert "| nvidia | bf16 | train | 250,000 | 0.250 | 30,000 | 1.20x | 1.25x, 0.75x |" in text
    assert "| nvidia | bf16 | eval | 300,000 | 0.200 | 8,000 |  | 0.97x, 1.14x |" in text
    assert "- nvidia train bf16: 250,000 tokens/s against >= 200,000: met" in text
    assert "- nvidia eval bf16: 300,000 tokens/s against >= 400,000: missed" in text
    assert "- nvidia train bf16 MFU 0.250 against >= 0.3: missed" in text
    assert "- nvidia bf16 train: compiled faster than eager: met" in text
    assert "- nvidia bf16 train: fused faster and smaller than reference: met" in text
    assert "- nvidia bf16 eval: fused faster and smaller than reference: missed" in text
    assert "- FAILED bench-compiled: nvidia bf16 eval: over --worker-timeout 200 s" in text
    assert gs.verdicts([]) == ""
