"""The GPU checks of issues 34 and 26 in one command, sized to a lease of device time.

A GPU is lent to a session by chance and for minutes (at present 15 minutes of device time, the machine's
start included, at most 10 minutes a command). So the checks are prepared here, run as one command, most
valuable first, each in a subprocess with its own time limit, and everything they measure is written as it
comes: a step cut off by the budget keeps its finished measurements, and a second call runs what is left
(``--skip`` the steps done). Issue 34's come first and fit one 9-minute command (``--budget 530``): every
``-m gpu`` test; NVIDIA's shape in bf16, eager and through CUDA graphs (``txl.graphs``), each with one profiled
step (host against device time); the same with every change of the issue switched back (``benchmarks.switches``:
an A/B in one lease), or the whole earlier tree (``--baseline-src``); serving on CUDA. On the lent machine (its
python3 holds a CUDA PyTorch; nothing can be fetched):

    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . &&
    PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu_session --out $OUT --budget 530

    python3 -m benchmarks.gpu_session --list                 # the steps, their limits and commands
    python3 -m benchmarks.gpu_session --smoke --out /tmp/s   # the same machinery on a CPU, tiny shapes

Written to --out (at most 8 files, as the device tool brings back): ``summary.md`` (each step's outcome and its
tables, issue 34's targets and the benchmark rows against issue 26's; also printed), ``targets.md`` (issue 34's
targets table alone: training >= 200,000 and evaluation >= 400,000 tokens/s, host below device time, CUDA
graphs >= eager, every ``-m gpu`` test passing, and each A/B), ``session.log`` (every step's whole output),
``env.json`` (GPU, driver, torch and CUDA versions), ``results.jsonl`` (the benchmark rows of every step, each
with its step's name), ``speedup.md`` / ``speedup.json`` (the paper's Table 9 lengths).

The oracle on CUDA (``test_hf_parity_on_cuda``) needs transformers 4.37.2, which the GPU image lacks (it
has 5.x, without TransfoXL): carry its wheels (benchmarks/README.md, "A GPU session") and pass
``--oracle-site /tmp/site``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import sessions, switches
from txl.fileio import append_jsonl, read_jsonl, write_text

ROOT = Path(__file__).resolve().parents[1]
PAPER_LENGTHS = "800,1800,2800,3800"  # Dai et al. 2019, Table 9


@dataclass(frozen=True)
class Step:
    name: str
    what: str  # the step it answers
    argv: tuple[str, ...]
    cap_s: float  # the most it may run
    min_s: float  # not started with less of the budget left
    env: dict[str, str] = field(default_factory=dict)
    bench: str | None = None  # a benchmarks.run --out directory: its results.jsonl is merged
    files: tuple[str, ...] = ()  # files the step writes, copied to --out after it
    needs: tuple[str, ...] = ()  # modules that must import, else the step is skipped and says why


WAYS = ("eager", "compiled", "graphs", "step", "step-eager")
"""benchmarks.run's modes, each a row of issue 46's comparison."""

GPU_TESTS = ("tests",)
"""Where the ``-m gpu`` tests are collected from: all of the suite, so that none is left out."""


def bench_step(name: str, what: str, work: Path, device: str, worker_timeout: float, cap_s: float, min_s: float,
               *more: str) -> Step:
    """A ``benchmarks.run`` step (no speed-up sweep; a failed measurement is a row) writing into ``work / name``."""
    out = work / name
    return Step(name, what, (sys.executable, "-m", "benchmarks.run", "--device", device, "--lengths", "--keep-going",
                             "--worker-timeout", f"{worker_timeout:g}", "--out", str(out), *more), cap_s, min_s,
                bench=str(out))


def plan(device: str, work: Path, *, smoke: bool = False, oracle_site: str | None = None,
         baseline_src: str | None = None) -> list[Step]:
    """The checks in the order they run, most valuable first: issue 34's within one 9-minute command (the
    ``-m gpu`` tests; NVIDIA's shape in bf16 eager, through CUDA graphs (txl.graphs) and with every change of the
    issue switched back, each profiled once for host and device time; the whole earlier tree with
    ``baseline_src``; serving; each change alone; base at GPU size), then issue 26's remaining ones for a second
    call (the paper's speed-up lengths, DDP/FSDP2 in a group of one, reference attention, the whole suite)."""
    py = sys.executable
    if smoke:  # the same steps on a CPU at the smallest sizes: the machinery, not the figures
        shapes, big, dtype, reps = ["tiny"], ["tiny"], "fp32", ["--steps", "1", "--warmup", "0", "--threads", "1"]
        lengths, speedup_shape, serve_batch = "8,16", "tiny", ["1", "2"]
        graphs = ["--graphs-backend", "aot_eager"]  # dynamo's graphs without inductor's code generation
        ways = [w for w in WAYS if w != "compiled"]  # inductor's C++ code generation takes minutes on a busy CPU
    else:
        shapes, big, dtype, reps = ["nvidia"], ["base-gpu"], "bf16", []
        lengths, speedup_shape, serve_batch = PAPER_LENGTHS, "small", ["1", "8", "32"]
        graphs, ways = [], list(WAYS)
    pytest = (py, "-m", "pytest", "-p", "no:cacheprovider")
    phases = ("--dtypes", dtype, "--phases", "train", "eval")
    every = switches.available()  # the changes this txl holds (the model-side ones once merged)
    steps = [
        Step("env", "the device", (py, "-m", "benchmarks.gpu_session", "--describe", device,
                                   "--env-out", str(work / "env.json")), 60, 10, files=(str(work / "env.json"),)),
        # Issue 46: every way of running a step side by side at NVIDIA's shape, then at base's GPU size, each
        # profiled once (host against device time) and its compilation and capture timed apart ('warmup_s');
        # 'step-eager' is the A/B of the compilation inside the captured step (evaluation has no captured step).
        bench_step("bench-46", "eager, compiled, graphs (forward and backward), the whole step captured (compiled and "
                   "eager kernels), profiled once", work, device, 150, 420, 120, "--shapes", *shapes, *phases,
                   "--modes", *ways, "--profile", *graphs, *reps),
        Step("gpu-tests", "every -m gpu test", (*pytest, "-q", "-rfEs", "-m", "gpu",
                                                     "--continue-on-collection-errors", *GPU_TESTS), 240, 45),
    ]
    if oracle_site:
        steps.append(Step("oracle-cuda", "the oracle on CUDA", (*pytest, "-q", "-rfEs", "-m", "gpu and oracle",
                                                                "tests/test_gpu.py"), 120, 30,
                          env={"PYTHONPATH": os.pathsep.join([oracle_site, os.environ.get("PYTHONPATH", "")])}))
    steps += [
        bench_step("bench-eager", "eager, profiled once", work, device, 100, 120, 40,
                   "--shapes", *shapes, *phases, "--modes", "eager", "--profile", *reps),
        bench_step("bench-graphs", "CUDA graphs (training: txl.graphs; evaluation: key/value rings, txl.static_eval), "
                   "profiled once", work, device,
                   200, 300, 90, "--shapes", *shapes, *phases, "--modes", "graphs", "--profile", *graphs, *reps),
        bench_step("bench-before", "eager with every change of issue 34 switched back (A/B)", work, device, 100, 120,
                   40, "--shapes", *shapes, *phases, "--modes", "eager", "--before", *every, *reps),
    ]
    if baseline_src:  # the earlier tree's txl, imported first by the step's benchmark and its workers
        step = bench_step("bench-baseline", "eager, the earlier tree (--baseline-src)", work, device, 100, 120, 40,
                          "--shapes", *shapes, *phases, "--modes", "eager", *reps)
        steps.append(dataclasses.replace(step, env={"PYTHONPATH": os.pathsep.join(
            [str(Path(baseline_src).resolve()), str(ROOT), os.environ.get("PYTHONPATH", "")])}))
    steps += [
        Step("serve-engine", "serving, the engine's batched read and generation",
             (py, "-m", "benchmarks.serve_step", "--device", device, "--batch", *serve_batch,
              "--repeats", "1" if smoke else "3", "--steps", "2" if smoke else "32"), 90, 20),
        # Issue 47: the captured decode step beside eager and compiled, the small model and transfo-xl-wt103's shape
        # (random weights). On the GPU each engine's graphs are compiled (inductor) and captured in an untimed round
        # first; the smoke runs the machinery on a CPU without inductor, at a short memory.
        Step("serve-captured", "serving: the captured decode step (a CUDA graph per batch bucket) beside eager and "
                               "compiled, the small and the wt103-shaped model",
             (py, "-m", "benchmarks.serve_step", "--device", device, "--batch", *serve_batch, "--captured",
              "--at-end", "--shapes", "small", "wt103",
              *(["--repeats", "1", "--steps", "2", "--segment-len", "16", "--wt103-mem-len", "16"] if smoke else
                ["--compile", "--repeats", "3", "--steps", "32"])), 480, 120),
        Step("launches", "launched ops, copies and host syncs of one NVIDIA-structured step, counted on the device "
                         "(tests/test_launches.py holds the CPU's count of the same step)",
             (py, "-m", "benchmarks.launches", "--device", device), 120, 30),
        *[bench_step(f"bench-before-{name}", f"eager with {name} switched back: {switches.SWITCHES[name].what}",
                     work, device, 100, 120, 35, "--shapes", *shapes, *phases, "--modes", "eager", "--before", name,
                     *reps) for name in every if len(every) > 1],  # one switch: bench-before is it
        bench_step("bench-big", "every way of running a step at base's GPU size, profiled once", work, device, 150,
                   420, 120, "--shapes", *big, *phases, "--modes", *ways, "--profile", *graphs, *reps),
        Step("flex", "FlexAttention (positional score_mod) beside SDPA, one layer, forward and backward",
             (py, "-m", "benchmarks.flex", *(["--smoke", "--reps", "1"] if smoke else ["--device", device])), 150, 60),
        Step("speedup", "evaluation speed-up at the paper's lengths",
             (py, "-m", "experiments.speedup", "--device", device, "--shape", speedup_shape, "--lengths", lengths,
              "--reps", "2" if smoke else "10", "--results", str(work / "speedup")), 180, 30,
             files=(str(work / "speedup" / "speedup.md"), str(work / "speedup" / "speedup.json"))),
        Step("parallel-one", "DDP and FSDP2 over NCCL in a group of one, a DCP round trip",
             (py, "-m", "benchmarks.parallel_one", "--device", device,
              *(["--precisions", "fp32", "--steps", "2"] if smoke else [])), 150, 30),
        Step("serve-compiled", "serving with compiled generation steps (txl.compiled_step) beside eager",
             (py, "-m", "benchmarks.serve_step", "--device", device, "--batch", *serve_batch, "--compile",
              "--repeats", "1" if smoke else "3", "--steps", "2" if smoke else "32"), 150, 60),
        bench_step("bench-reference", "reference attention beside fused", work, device, 100, 300, 60,
                   "--shapes", *shapes, *phases, "--compute.attn_impl", "reference", *reps),
        Step("serve-http", "txl serve, sessions read concurrently",
             (py, "-m", "benchmarks.serve_throughput", "--sessions", *(["1", "2"] if smoke else ["1", "4", "16"]),
              "--seconds", "1" if smoke else "5", "--rounds", "1"), 180, 60,
             needs=("fastapi", "uvicorn", "httpx")),
        Step("suite", "the whole suite on the GPU machine",
             (*pytest, "-v", "--tb=line", "-rfE", *(["tests/test_imports.py"] if smoke else [])), 600, 120),
    ]
    return steps


# -- running -----------------------------------------------------------------------------------------------
def run_step(step: Step, limit: float, log: Path) -> tuple[str, float, str]:
    """Run one step for at most ``limit`` seconds; (outcome, seconds, its output). The step writes straight into
    ``log``, so one killed at its limit keeps what it printed."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **step.env}
    with open(log, "a+b") as f:
        f.write(f"\n===== {step.name}: {' '.join(step.argv)}\n".encode())
        f.flush()
        offset = f.tell()
        start = time.monotonic()
        # A session of its own: at the limit the step ends with everything it started (servers, compile workers).
        proc, _, _, timed_out = sessions.run(step.argv, limit, stdout=f, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, cwd=ROOT, env=env)
        seconds = time.monotonic() - start
        outcome = f"stopped at its limit ({limit:.0f} s)" if timed_out else \
            ("ok" if proc.returncode == 0 else f"failed (exit status {proc.returncode})")
        f.seek(offset)  # the file is opened for appending: reads go where asked, writes to its end
        output = f.read().decode(errors="replace")
        f.write(f"===== {step.name}: {outcome} in {seconds:.0f} s\n".encode())
    return outcome, seconds, output


def tables(output: str, keep: int = 80) -> str:
    """A step's printed tables and verdicts: its output less JSON rows, pytest's progress dots and PASSED lines."""
    text = [line for line in output.splitlines()
            if line.strip() and not line.startswith("{") and " PASSED" not in line
            and not set(line.split("[")[0].strip()) <= set(".sxX")]
    return "\n".join(text[-keep:])


def merge_results(step: Step, out: Path) -> list[dict]:
    """The step's benchmark rows (as many as were written before it ended), tagged with the step and appended to
    --out's results.jsonl."""
    path = Path(step.bench) / "results.jsonl"
    rows = [{"step": step.name, **row} for row in read_jsonl(path)[0]] if path.is_file() else []
    for row in rows:
        append_jsonl(out / "results.jsonl", row)
    return rows


def pytest_counts(output: str) -> str:
    """pytest's closing counts ('1 failed, 18 passed, 3 skipped, 38 deselected'), or '' if the output has none."""
    found = re.findall(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", output, flags=re.M)
    return found[-1].strip() if found else ""


def missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


# Issue 26's targets on one H100 (bf16, NVIDIA's WikiText-103 base shape): tokens/s and MFU of the bf16 peak.
TARGETS = {("nvidia", "train"): 200_000, ("nvidia", "eval"): 400_000}
BIG_EVAL = 1_500_000
"""Issue 46: base's GPU size (B 32, T = M = 512) evaluation tokens/s, bf16."""
TARGET_MFU = 0.30


def verdicts(rows: list[dict]) -> str:
    """The benchmark rows of every step side by side, against the issue's targets: eager tokens/s, MFU (of the
    bf16 peak on a GPU) and memory; compiled / eager and fused (eager) / reference ratios; targets met or not."""
    def table(step: str) -> dict[tuple, dict]:
        return {(r["shape"], r["dtype"], r["kind"]): r for r in rows
                if r.get("step") == step and r.get("kind") in ("train", "eval")}

    eager, compiled, reference = table("bench-eager"), table("bench-compiled"), table("bench-reference")
    if not eager:
        return ""

    def mfu(r: dict) -> float:
        return r.get("mfu_vs_bf16_peak", r["mfu"])

    def memory(r: dict) -> float:
        return r.get("peak_mem_mb", r.get("peak_rss_mb", float("nan")))

    lines = ["## Against the targets", "",
             "| shape | dtype | phase | tokens/s | MFU | memory MB | compiled / eager | fused / reference (speed, "
             "memory) |", "|---|---|---|---|---|---|---|---|"]
    checks = []
    for key, r in sorted(eager.items()):
        c, ref = compiled.get(key), reference.get(key)
        ratio = f"{c['tokens_per_s'] / r['tokens_per_s']:.2f}x" if c else ""
        fused = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x, {memory(r) / memory(ref):.2f}x" if ref else ""
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {r['tokens_per_s']:,.0f} | {mfu(r):.3f} | {memory(r):,.0f} "
                     f"| {ratio} | {fused} |")
        target = TARGETS.get((key[0], key[2])) if key[1] == "bf16" else None
        if target:
            met = "met" if r["tokens_per_s"] >= target else "missed"
            checks.append(f"- {key[0]} {key[2]} bf16: {r['tokens_per_s']:,.0f} tokens/s against >= {target:,}: {met}")
        if key[1] == "bf16" and key[0] == "nvidia" and key[2] == "train":
            met = "met" if mfu(r) >= TARGET_MFU else "missed"
            checks.append(f"- nvidia train bf16 MFU {mfu(r):.3f} against >= {TARGET_MFU}: {met}")
        if c:
            met = "met" if c["tokens_per_s"] > r["tokens_per_s"] else "missed"
            checks.append(f"- {' '.join(key)}: compiled faster than eager: {met}")
        if ref:
            met = "met" if r["tokens_per_s"] > ref["tokens_per_s"] and memory(r) < memory(ref) else "missed"
            checks.append(f"- {' '.join(key)}: fused faster and smaller than reference: {met}")
    failed = [r for r in rows if r.get("kind") == "failed"]
    checks += [f"- FAILED {r['step']}: {r['shape']} {r['dtype']} {r['phase']}: {r['failure']} {r['error']}"
               for r in failed]
    return "\n".join(lines + [""] + checks + [""])


_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def profile_totals(table: str) -> tuple[float | None, float | None]:
    """(host ms, device ms) from a profiler table's own total lines ("Self CPU time total: 8.229ms", "Self CUDA time
    total: 6.539ms"); None for a line the table lacks (a CPU profile has no device line)."""
    def total(label: str) -> float | None:
        found = re.search(rf"Self {label} time total: ([0-9.]+)(us|ms|s)\b", table or "")
        return float(found.group(1)) * _UNITS_MS[found.group(2)] if found else None

    return total("CPU"), total("CUDA")


PLAIN_STEPS = ("bench-46", "bench-eager", "bench-graphs", "bench-big")
"""The steps measuring the code as it is (the others switch changes back, or run the earlier tree)."""


def mode(r: dict) -> str:
    """As ``benchmarks.run.mode_of`` (not imported: this module runs without torch for --list)."""
    if r.get("captured"):  # benchmarks.run's row: the whole step captured, its model compiled or not
        return "step" if r["captured"] == "compiled" else "step-eager"
    return "graphs" if r.get("graphs") else ("compiled" if r.get("compile") else "eager")


def targets(rows: list[dict], done: list[tuple[str, str, float]]) -> str:
    """Issue 34's targets, each measured or not, met or missed: NVIDIA's shape in bf16 at >= 200,000 training and
    >= 400,000 evaluation tokens/s (the faster of eager and CUDA graphs), a profiled step's host time below its
    device time, CUDA graphs at least as fast as eager at every shape measured, every ``-m gpu`` test passing;
    then each change's A/B (the rows with changes switched back, or the earlier tree, against the plain eager
    row of the same shape and phase)."""
    runs = [r for r in rows if r.get("kind") in ("train", "eval")]
    plain = [r for r in runs if r.get("step") in PLAIN_STEPS and not r.get("before")]
    lines = ["## Issue 34's targets", "", "| target | measured | verdict |", "|---|---|---|"]
    for kind, floor in (("train", TARGETS["nvidia", "train"]), ("eval", TARGETS["nvidia", "eval"])):
        cands = [r for r in plain if r["shape"] == "nvidia" and r["kind"] == kind and r["dtype"] == "bf16"]
        if cands:
            r = max(cands, key=lambda r: r["tokens_per_s"])
            mfu = r.get("mfu_vs_bf16_peak", r["mfu"])
            lines.append(f"| nvidia {kind} bf16 >= {floor:,} tokens/s | {r['tokens_per_s']:,.0f} ({mode(r)}; MFU "
                         f"{mfu:.3f}) | {'met' if r['tokens_per_s'] >= floor else 'missed'} |")
        else:
            lines.append(f"| nvidia {kind} bf16 >= {floor:,} tokens/s | not measured | - |")
    cands = [r for r in plain if r["shape"] == "base-gpu" and r["kind"] == "eval" and r["dtype"] == "bf16"]
    if cands:
        r = max(cands, key=lambda r: r["tokens_per_s"])
        lines.append(f"| base-gpu eval bf16 >= {BIG_EVAL:,} tokens/s | {r['tokens_per_s']:,.0f} ({mode(r)}) | "
                     f"{'met' if r['tokens_per_s'] >= BIG_EVAL else 'missed'} |")
    profiled = [r for r in plain if r.get("profile") and not r.get("profile_error")]
    for r in profiled:
        # The profiler's own totals, each kernel counted once (a row's profile_device_ms before issue 43 added the
        # launching ops' and a compiled graph's range to the kernels: twice the device time); unreadable: no verdict.
        host, dev = profile_totals(r["profile"])
        name = f"host < device time per step: {r['shape']} {r['kind']} {r['dtype']} {mode(r)}"
        if host is None or dev is None:
            lines.append(f"| {name} | not measured (the profile has no host or device total) | - |")
        else:
            lines.append(f"| {name} | host {host:.1f} ms, device {dev:.1f} ms | {'met' if host < dev else 'missed'} |")
    for r in (r for r in plain if r.get("profile_error")):
        lines.append(f"| host < device time per step: {r['shape']} {r['kind']} {r['dtype']} {mode(r)} | the profile "
                     f"failed: {r['profile_error'][-120:]} | - |")
    if not profiled:
        lines.append("| host < device time per step | not measured (no profiled GPU step) | - |")
    by = {(r["shape"], r["dtype"], r["kind"], mode(r)): r for r in plain}
    pairs = [(key, by[key], by[(*key[:3], "eager")]) for key in by if key[3] != "eager" and (*key[:3], "eager") in by]
    for key, fast, eager in pairs:
        ratio = fast["tokens_per_s"] / eager["tokens_per_s"]
        lines.append(f"| {key[3]} >= eager: {' '.join(key[:3])} | {ratio:.2f}x ({fast['tokens_per_s']:,.0f} against "
                     f"{eager['tokens_per_s']:,.0f}) | {'met' if ratio >= 1 else 'missed'} |")
    if not pairs:
        lines.append("| compiled >= eager at every shape | not measured | - |")
    tests = next((o for n, o, _ in done if n == "gpu-tests"), None)
    if tests is None or tests.startswith("not run"):
        verdict = "-"
    elif not tests.startswith("ok"):
        verdict = "missed"
    else:
        verdict = "met" if " passed" in tests else "not measured (none ran here)"
    lines.append(f"| every -m gpu test passing | {tests or 'not run'} | {verdict} |")
    warm = [f"| {r['shape']} {r['kind']} {r['dtype']} {mode(r)} | {r['warmup_steps']} | {r['warmup_s']:.1f} |"
            for r in plain if "warmup_s" in r]
    if warm:
        lines += ["", "Compilation and capture, apart from the timed rows: the untimed first steps' wall time.", "",
                  "| shape phase dtype mode | untimed steps | seconds |", "|---|---|---|", *warm]
    ab = [f"| {key[0]} {key[2]} {key[1]} | the captured step's model through inductor, against eager kernels | "
          f"{by[(*key[:3], 'step-eager')]['tokens_per_s']:,.0f} | {r['tokens_per_s']:,.0f} | "
          f"{r['tokens_per_s'] / by[(*key[:3], 'step-eager')]['tokens_per_s']:.2f}x |"
          for key, r in by.items() if key[3] == "step" and (*key[:3], "step-eager") in by]
    for r in runs:
        if not (r.get("before") or r.get("step") == "bench-baseline"):
            continue
        now = by.get((r["shape"], r["dtype"], r["kind"], mode(r)))
        what = "the earlier tree" if r.get("step") == "bench-baseline" else ", ".join(r["before"]) + " switched back"
        if now:
            ab.append(f"| {r['shape']} {r['kind']} {r['dtype']} {mode(r)} | {what} | {r['tokens_per_s']:,.0f} | "
                      f"{now['tokens_per_s']:,.0f} | {now['tokens_per_s'] / r['tokens_per_s']:.2f}x |")
    if ab:
        lines += ["", "A/B: each change (or all of them) against the code as it is, same worker, same lease.", "",
                  "| shape phase dtype mode | before | tokens/s before | tokens/s now | now / before |",
                  "|---|---|---|---|---|", *ab]
    return "\n".join(lines + [""])


def summary(done: list[tuple[str, str, float]], sections: list[str], rows: list[dict], budget: float, used: float,
            out: Path) -> str:
    head = ["# GPU session", "", f"budget {budget:.0f} s, used {used:.0f} s", "",
            "| step | outcome | seconds |", "|---|---|---|", *(f"| {n} | {o} | {s:.0f} |" for n, o, s in done), ""]
    env = out / "env.json"
    if env.is_file():
        head += ["```", env.read_text().strip(), "```", ""]
    return "\n".join(head + [targets(rows, done), verdicts(rows)] + sections)


def run_session(steps: list[Step], out: Path, budget: float) -> list[tuple[str, str, float]]:
    """Run ``steps`` in order within ``budget`` seconds; returns (name, outcome, seconds). summary.md is written
    after every step (a command killed from outside keeps it) and printed at the end."""
    start = time.monotonic()
    done: list[tuple[str, str, float]] = []
    sections: list[str] = []
    rows: list[dict] = []  # every benchmark step's rows, as in --out's results.jsonl
    log = out / "session.log"
    for step in steps:
        left = budget - (time.monotonic() - start)
        if left < step.min_s:
            done.append((step.name, f"not run: {left:.0f} s of the budget left, it needs {step.min_s:.0f}", 0.0))
            continue
        if absent := missing(step.needs):
            done.append((step.name, f"not run: {', '.join(absent)} not installed", 0.0))
            continue
        print(f"[{time.monotonic() - start:5.0f} s] {step.name} ({step.what}), up to {min(left, step.cap_s):.0f} s",
              flush=True)
        outcome, seconds, output = run_step(step, min(left, step.cap_s), log)
        if counts := pytest_counts(output):
            outcome += f"; {counts}"
        if step.bench:
            new = merge_results(step, out)
            rows += new
            outcome += f"; {len(new)} benchmark rows"
        for name in map(Path, step.files):
            if name.is_file():
                shutil.copy(name, out / name.name)
        done.append((step.name, outcome, seconds))
        sections.append(f"## {step.name}: {step.what} ({outcome}, {seconds:.0f} s)\n\n`{' '.join(step.argv[1:])}`"
                        f"\n\n```\n{tables(output)}\n```\n")
        print(f"        {outcome} in {seconds:.0f} s", flush=True)
        write_text(out / "summary.md", summary(done, sections, rows, budget, time.monotonic() - start, out))
        write_text(out / "targets.md", targets(rows, done))
    text = summary(done, sections, rows, budget, time.monotonic() - start, out)
    write_text(out / "summary.md", text)
    print(text)
    return done


# -- the env step --------------------------------------------------------------------------------------------
def describe(device: str, path: Path) -> dict:
    """The device, its driver, torch and CUDA versions, where txl is imported from, the bf16 and TF32 matmul peaks."""
    import torch

    import txl

    info: dict = dict(torch=torch.__version__, cuda=torch.version.cuda, python=sys.version.split()[0],
                      txl=txl.__version__, txl_from=str(Path(txl.__file__).parent), device=device)
    if device.startswith("cuda"):
        dev = torch.device(device)
        props = torch.cuda.get_device_properties(dev)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported())
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            info["nvidia_smi"] = f"unavailable: {err}"
        from benchmarks.instruments import make_clock
        from benchmarks.run import device_peaks
        info.update({k.replace("_flops", "_tflops"): round(v / 1e12, 1)
                     for k, v in device_peaks(dev, make_clock(dev)).items()})  # as every benchmark worker measures
    else:
        from benchmarks.instruments import cpu_model
        info["name"] = cpu_model()
    write_text(path, json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_session", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="where the results go (the device tool's $OUT); emptied of ours first")
    p.add_argument("--budget", type=float, default=530,
                   help="seconds for all the steps together (default 530: one 9-minute command)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cuda:N; cpu with --smoke")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one step each: check the machinery on a CPU")
    p.add_argument("--skip", default="", help="comma-separated steps not to run (a second call: the ones done)")
    p.add_argument("--only", default="", help="comma-separated steps to run, in the plan's order")
    p.add_argument("--oracle-site", help="a directory holding transformers 4.37.2 and its pins (carried wheels)")
    p.add_argument("--baseline-src", help="a directory holding an earlier txl package (DIR/txl), e.g. made by "
                                          "'git archive a4a52e2 src/txl | tar -x -C .baseline' as .baseline/src: "
                                          "the bench-baseline step measures it beside the code as it is")
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    p.add_argument("--describe", help=argparse.SUPPRESS)  # the env step, run as a subprocess
    p.add_argument("--env-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.describe:
        describe(args.describe, args.env_out)
        return 0
    device = "cpu" if args.smoke and args.device == "cuda" else args.device
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "txl-gpu-session"
    if args.baseline_src and not (Path(args.baseline_src) / "txl" / "__init__.py").is_file():
        p.error(f"--baseline-src {args.baseline_src}: no txl package there (DIR/txl/__init__.py); give the "
                "directory that holds it, e.g. .baseline/src")
    steps = plan(device, work, smoke=args.smoke, oracle_site=args.oracle_site, baseline_src=args.baseline_src)
    names = [s.name for s in steps]
    for flag, value in (("--skip", args.skip), ("--only", args.only)):
        unknown = [n for n in value.split(",") if n and n not in names]
        if unknown:
            p.error(f"{flag} {value}: no step {', '.join(unknown)}; the steps are {', '.join(names)}")
    if args.only:
        steps = [s for s in steps if s.name in args.only.split(",")]
    steps = [s for s in steps if s.name not in args.skip.split(",")]
    if args.list:
        for s in steps:
            print(f"{s.name:<16} up to {s.cap_s:4.0f} s (not started under {s.min_s:3.0f} s)  {s.what}\n"
                  f"{'':<16} {' '.join(s.argv[1:])}")
        return 0
    if args.out is None:
        p.error("--out DIR is needed (on the device machine: --out $OUT)")
    if args.budget <= 0:
        p.error(f"--budget {args.budget:g}: give a positive number of seconds")
    if device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            p.error(f"--device {device}: CUDA is not available on this machine; --smoke checks the steps on a CPU")
    try:
        import txl  # noqa: F401 (the steps' subprocesses import it the same way)
    except ImportError:
        p.error("txl does not import: pip install --no-deps --no-build-isolation --no-index -e . first")
    # A time limit from outside stops the running step's session too (a machine keeps a session of its own
    # running after the command otherwise).
    sessions.exit_on_sigterm()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("summary.md", "targets.md", "session.log", "env.json", "results.jsonl", "speedup.md", "speedup.json"):
        (args.out / name).unlink(missing_ok=True)
    done = run_session(steps, args.out, args.budget)
    return 0 if all(o.startswith(("ok", "not run")) for _, o, _ in done) else 1


if __name__ == "__main__":
    raise SystemExit(main())
