"""Beyond one process: FSDP2 against DDP against one process, DCP checkpoints resharded 2 -> 1 and 2 -> 4,
an elastic restart after kill -9, and two torchrun "nodes" on 127.0.0.1.

Each test launches few jobs (tiny model, OMP_NUM_THREADS=1, generous timeouts, ports chosen by torchrun
itself where it can); every comparison of a test reads the same launches.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import txl
from txl.cli import main

TINY = ["--preset", "tiny", "--model.n_layer", "2", "--model.d_model", "32", "--model.n_head", "2",
        "--model.d_head", "16", "--model.d_inner", "64", "--model.mem_len", "8", "--model.dropout", "0",
        "--train.tgt_len", "8", "--train.log_interval", "1", "--train.progress", "false",
        "--train.tensorboard", "false", "--train.plot", "false", "--eval.batch_size", "4", "--eval.mem_len", "16",
        "--train.eval_batches", "2", "--train.eval_interval", "0", "--train.keep_last", "10"]
TIMEOUT = 600  # seconds per launch: the machine is shared and busy


def args(corpus, out, *more):
    return [*TINY, "--data.corpus", corpus, "--data.level", "byte", "--out", str(out), *more]


def torchrun(*launch, env=None):
    """``python -m torch.distributed.run LAUNCH... -m txl train``'s command (the caller adds the train args)."""
    return [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "txl", "train"]


def environment():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(txl.__file__).parents[1])}


def run(cmd, **kw):
    proc = subprocess.run(cmd, env=environment(), capture_output=True, text=True, timeout=TIMEOUT, **kw)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def losses(out):
    rows = [json.loads(r) for r in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def weights(checkpoint):
    return txl.from_pretrained(checkpoint).state_dict()


def max_difference(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_fsdp_equals_ddp_and_one_process_and_reshards(corpus, tmp_path, capsys):
    """One global batch of 8 streams: one process; DDP over 2 (2 accumulation chunks each); FSDP2 over 2 with
    activation checkpointing. Then the FSDP run's step-3 DCP checkpoint resumed at 1 and at 4 processes."""
    common = ["--max-steps", "6", "--train.batch_size", "8", "--train.ckpt_interval", "3"]
    single, ddp, fsdp = tmp_path / "single", tmp_path / "ddp", tmp_path / "fsdp"
    assert main(["train", *args(corpus, single, *common)]) == 0
    run(torchrun("--standalone", "--nproc_per_node", "2") + args(corpus, ddp, *common, "--train.grad_accum", "2"))
    run(torchrun("--standalone", "--nproc_per_node", "2")
        + args(corpus, fsdp, *common, "--train.grad_accum", "2", "--train.parallel", "fsdp",
               "--train.activation_checkpointing", "true"))
    a, b, c = losses(single), losses(ddp), losses(fsdp)
    assert sorted(a) == sorted(b) == sorted(c) == [1, 2, 3, 4, 5, 6]
    for other in (b, c):
        torch.testing.assert_close(torch.tensor([other[s] for s in a]), torch.tensor(list(a.values())),
                                   rtol=0, atol=1e-5)
    last = Path("checkpoints") / "step_00000006"
    w = {name: weights(run_dir / last) for name, run_dir in (("single", single), ("ddp", ddp), ("fsdp", fsdp))}
    assert max_difference(w["single"], w["ddp"]) < 1e-5
    assert max_difference(w["single"], w["fsdp"]) < 1e-5
    # DDP checkpoints stay model directories; FSDP's hold each process's shard and no full weights file.
    assert (ddp / last / "model.safetensors").is_file() and not (ddp / last / "dcp").exists()
    assert sorted(p.name for p in (fsdp / last / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (fsdp / last / "model.safetensors").exists()
    assert not list((fsdp / "checkpoints").glob(".tmp-*"))  # every checkpoint complete, nothing half-written

    # Reshard: the step-3 checkpoint of the 2-process run continues at 1 process and at 4.
    one, four = tmp_path / "one", tmp_path / "four"
    for copy in (one, four):
        shutil.copytree(fsdp, copy)
    assert main(["train", "--resume", str(one / "checkpoints" / "step_00000003")]) == 0
    run(torchrun("--standalone", "--nproc_per_node", "4") + ["--resume", str(four / "checkpoints" / "step_00000003")])
    for resumed in (one, four):
        d = losses(resumed)
        assert sorted(d) == [1, 2, 3, 4, 5, 6]
        assert max(abs(d[s] - c[s]) for s in (4, 5, 6)) < 1e-5, (resumed.name, d, c)
        assert max_difference(weights(resumed / last), w["fsdp"]) < 1e-5

    # Direct reading (txl eval through from_pretrained) and consolidation into a plain model directory.
    capsys.readouterr()
    assert main(["eval", str(fsdp), "--split", "valid"]) == 0
    assert "loss" in capsys.readouterr().out
    assert main(["consolidate", str(fsdp), "-o", str(tmp_path / "model")]) == 0
    assert (tmp_path / "model" / "model.safetensors").is_file() and (tmp_path / "model" / "tokenizer").is_dir()
    assert max_difference(weights(tmp_path / "model"), w["fsdp"]) == 0
    assert main(["train", "--resume", str(fsdp), "--train.parallel", "ddp"]) == 2
    assert "is a sharded (--train.parallel fsdp) checkpoint" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of the torchrun worker below ``parent`` whose RANK is ``rank``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RESTART_COUNT=0" in env \
                and int(stat[1]) == parent and b"txl" in (entry / "cmdline").read_bytes():
            return int(entry.name)
    return None


@pytest.mark.slow
def test_elastic_restart_after_kill_and_two_nodes(corpus, tmp_path):
    """kill -9 of rank 1 mid-run under --max-restarts 1: the job resumes from its checkpoint by itself and its
    final weights are byte-identical to an uninterrupted run's; so are those of two torchrun launchers acting
    as two nodes (c10d rendezvous on 127.0.0.1)."""
    common = ["--max-steps", "60", "--train.batch_size", "4", "--train.ckpt_interval", "5"]
    plain, killed, nodes = tmp_path / "plain", tmp_path / "killed", tmp_path / "nodes"
    run(torchrun("--standalone", "--nproc_per_node", "2") + args(corpus, plain, *common))

    err = tmp_path / "killed.err"
    with open(err, "w") as stderr:
        job = subprocess.Popen(torchrun("--standalone", "--nproc_per_node", "2", "--max-restarts", "1",
                                        "--monitor-interval", "0.1") + args(corpus, killed, *common),
                               env=environment(), stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        try:
            deadline = time.monotonic() + TIMEOUT
            while not (killed / "latest.json").is_file():  # the first checkpoint (step 5) is written
                assert job.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
                time.sleep(0.02)
            victim = _rank_pid(job.pid, 1)
            assert victim is not None, "rank 1 of the first attempt is gone before the kill"
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            # Rank 0 names the dead rank as soon as its collective fails; torchrun names it too when it ends the
            # job's other processes (its SIGTERM can end rank 0 first on a machine this busy).
            ours, torchruns = f"rank 1 (pid {victim}) of this distributed run died", f"local_rank: 1 (pid: {victim})"
            while ours not in err.read_text() and torchruns not in err.read_text():
                assert time.monotonic() - killed_at < 60, err.read_text()[-3000:]
                time.sleep(0.05)
            noticed = time.monotonic() - killed_at
            assert job.wait(timeout=TIMEOUT) == 0, err.read_text()[-4000:]
        finally:
            if job.poll() is None:
                job.kill()
    text = err.read_text()
    assert "torchrun restart 1 of this job: continuing" in text, text[-3000:]
    assert noticed < 30  # within seconds (0.2 s measured with --max-restarts 0; generous for a busy machine)
    assert json.loads((killed / "elastic.json").read_text())["attempt"] == 1  # the restart re-marked its run

    port = _free_port()
    launch = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"txl-test-{port}"]
    first = subprocess.Popen(torchrun(*launch, "--rdzv-conf", "is_host=true") + args(corpus, nodes, *common),
                             env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = subprocess.Popen(torchrun(*launch, "--rdzv-conf", "is_host=false") + args(corpus, nodes, *common),
                              env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for proc in (first, second):
            out, stderr_text = proc.communicate(timeout=TIMEOUT)
            assert proc.returncode == 0, stderr_text[-4000:]
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()

    last = Path("checkpoints") / "step_00000060" / "model.safetensors"
    reference = (plain / last).read_bytes()
    assert (killed / last).read_bytes() == reference
    assert (nodes / last).read_bytes() == reference
    assert losses(killed) == losses(plain) == losses(nodes)


# -- fast: the pieces, in one process ------------------------------------------------------------------

def test_memories_reshard_stream_by_stream():
    """Rank r of W holds streams [r B/W, (r+1) B/W), chunk a of its A the a-th slice: 2 ranks x 2 chunks of a
    batch of 8 streams become 4 ranks x 1 chunk, and 1 rank x 2 chunks, each stream keeping its own rows."""
    from txl.train_state import reshard_ranks

    streams = torch.arange(8.0)[:, None, None].expand(8, 3, 5)  # stream i's memory is filled with i: (B, M, d)
    layers = 2
    old = [{"rng": {"r": r}, "memories": [tuple(streams[4 * r + 2 * a:4 * r + 2 * a + 2] for _ in range(layers))
                                          for a in range(2)]} for r in range(2)]
    four = reshard_ranks(old, 4)
    assert [len(r["memories"]) for r in four] == [2] * 4  # grad_accum is kept: 8 streams = 4 x 2 x 1
    for r, part in enumerate(four):
        for a, memory in enumerate(part["memories"]):
            assert len(memory) == layers and all(m.shape == (1, 3, 5) for m in memory)
            assert float(memory[0][0, 0, 0]) == 2 * r + a
    assert [p["rng"]["r"] for p in four] == [0, 1, 0, 1]
    one = reshard_ranks(old, 1)
    assert [float(m[1][0, 0, 0]) for m in one[0]["memories"]] == [0.0, 4.0]  # chunk 0: streams 0-3
    assert reshard_ranks([{"rng": {}, "memories": [None]}] * 2, 4) == [{"rng": {}, "memories": [None]}] * 4
    with pytest.raises(ValueError, match="do not split over 3 process"):
        reshard_ranks(old, 3)


def test_a_restarted_job_continues_only_its_own_run(tmp_path):
    from txl.elastic import record_job, restart_plan

    job = {"TORCHELASTIC_RUN_ID": "job-1", "TORCHELASTIC_RESTART_COUNT": "0"}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert restart_plan(run_dir, None, False, job) == (None, False)  # the first attempt: as given
    record_job(run_dir, job)
    again = {**job, "TORCHELASTIC_RESTART_COUNT": "1"}
    assert restart_plan(run_dir, None, False, again) == (None, True)  # its own files, no checkpoint: start again
    (run_dir / "checkpoints" / "step_00000005").mkdir(parents=True)
    (run_dir / "latest.json").write_text(json.dumps({"step": 5, "path": "checkpoints/step_00000005"}))
    assert restart_plan(run_dir, None, False, again) == (str(run_dir), False)  # continue from latest
    assert restart_plan(run_dir, "x", True, again) == (str(run_dir), False)  # --overwrite only on the first
    other = {"TORCHELASTIC_RUN_ID": "job-2", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert restart_plan(run_dir, None, False, other) == (None, False)  # another job's run: not continued
    assert restart_plan(run_dir, None, False, {}) == (None, False)  # no torchrun


def test_size_prediction_within_15_percent_of_the_measured_peak(one_thread):
    """One process, the benchmark's small shape (benchmarks.scaling measures 2 processes, DDP and FSDP)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from benchmarks.scaling import SHAPE, run_config
    from txl.data import Batch
    from txl.distributed import DistInfo
    from txl.model import TransformerXL
    from txl.optim import build_optimizer
    from txl.sizing import estimate
    from txl.train import train_step

    for checkpointing in (False, True):
        cfg = run_config("ddp", checkpointing, 4, 32)
        model = TransformerXL(cfg.model)
        if checkpointing:
            from txl.parallel import checkpoint_layers
            checkpoint_layers(model)
        optimizer = build_optimizer(model, cfg.optim)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        tokens = torch.randint(0, SHAPE["vocab_size"], (4, 33))
        batch = Batch(input_ids=tokens[:, :-1], labels=tokens[:, 1:], context_len=0, start=1)
        info = DistInfo(rank=0, world_size=1, device=torch.device("cpu"))
        memories = [None]
        for _ in range(2):  # the memory fills; Adam's state exists
            _, memories = train_step(model, optimizer, scaler, batch, memories, lr=1e-4, clip=0.25, precision="fp32",
                                     info=info)
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            train_step(model, optimizer, scaler, batch, memories, lr=1e-4, clip=0.25, precision="fp32", info=info)
        measured = max(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
        predicted = estimate(cfg, world_size=1, parallel="ddp", checkpointing=checkpointing).peak
        assert abs(predicted - measured) / measured < 0.15, (checkpointing, predicted, measured)


def test_size_command(capsys):
    assert main(["size", "--preset", "tiny", "--world-size", "1,2,3", "--bytes"]) == 0
    out = capsys.readouterr().out
    assert "| fsdp | 2 | on |" in out and "3 processes: the batch of 8 streams does not split" in out
    assert main(["size", "--world-size", "two"]) == 2
    assert "--world-size 'two' must be comma-separated integers" in capsys.readouterr().err


def _tail_cluster_config() -> txl.ModelConfig:
    # vocab 256 split at 100 and 128 (div_val 2): the last cluster is tokens >= 128.
    return txl.ModelConfig(vocab_size=256, n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=8,
                           dropout=0.0, cutoffs=[100, 128], div_val=2)


def _tail_cluster_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(4, 9) token rows per step: rows 0-1 (process 0's) below 100 only; rows 2-3 (process 1's) cycle through the
    three clusters, so every cluster is used every step (where one is unused by all processes, FSDP steps Adam with
    its zero gradient while one process and DDP skip it: README, "FSDP")."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        low = torch.randint(0, 100, (2, 9), generator=g)
        mixed = torch.stack([torch.randint(0, 100, (2, 3), generator=g), torch.randint(100, 128, (2, 3), generator=g),
                             torch.randint(128, 256, (2, 3), generator=g)], dim=2).reshape(2, 9)  # (2, 9): a b c a b c
        rows = torch.cat([low, mixed])  # (4, 9)
        out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
    return out


def _train_rows(parallel_mode: str, rank: int, world_size: int, steps: int) -> tuple[list[float], dict]:
    """The library's wrap and step on this process's rows of every batch; (losses, full final weights)."""
    from benchmarks import parallel_one
    from txl import parallel
    from txl.config import OptimConfig
    from txl.distributed import DistInfo
    from txl.optim import build_optimizer

    info = DistInfo(rank=rank, world_size=world_size, device=torch.device("cpu"))
    torch.manual_seed(0)
    model = txl.TransformerXL(_tail_cluster_config()).train()
    step_model = parallel.wrap(model, info, parallel=parallel_mode, activation_checkpointing=False,
                               precision="fp32")
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    mine = slice(rank * 4 // world_size, (rank + 1) * 4 // world_size)  # this process's rows of the 4
    data = [(x[mine], y[mine]) for x, y in _tail_cluster_batches(steps)]
    losses, _ = parallel_one.train(step_model, optimizer, info, "fp32", data)
    return losses, parallel_one.full_weights(model)


def _tail_cluster_worker(rank: int, parallel_mode: str, store_file: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, store=dist.FileStore(store_file, 2))
    losses, weights = _train_rows(parallel_mode, rank, 2, steps=3)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        torch.save({"losses": losses, "weights": weights}, out)
    # Out without the interpreter's teardown: gloo's can rarely abort a process after destroy_process_group (seen
    # with and without this change; benchmarks/README.md), which is not what this test is about.
    os._exit(0)


@pytest.mark.slow  # two spawned processes per mode
@pytest.mark.parametrize("parallel_mode", ["fsdp", "ddp"])
def test_tail_clusters_used_by_one_process_only_train_as_one_process(parallel_mode, tmp_path):
    """The last cluster of the adaptive input and softmax (tokens >= 128) occurs only in process 1's rows: DDP
    (find_unused_parameters) and FSDP2 (every cluster runs, on no rows where unused) reduce the same tensors on both
    processes and train exactly as one process on all rows. FSDP aborted in gloo here before every_cluster, and
    needed torch 2.13 before that (set_reduce_scatter_unused_params)."""
    import torch.multiprocessing as mp

    out = tmp_path / "rank0.pt"
    mp.start_processes(_tail_cluster_worker, args=(parallel_mode, str(tmp_path / "store"), str(out)), nprocs=2,
                       start_method="spawn", join=True)
    got = torch.load(out)
    losses, weights = _train_rows("none", 0, 1, steps=3)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=0, atol=1e-5)
    assert max_difference(got["weights"], weights) < 1e-5


@pytest.mark.slow  # a subprocess that joins a process group of one
def test_ddp_and_fsdp_on_one_device_equal_the_plain_model_and_resume_from_dcp():
    """benchmarks.parallel_one (what a one-GPU machine can run of DDP and FSDP2, over NCCL there): on a CPU over
    gloo, in fp32, DDP and FSDP2 over one process train exactly as the plain model, and a sharded model loaded
    from the FSDP run's distributed checkpoint continues exactly as the run; one not loaded does not."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.parallel_one", "--device", "cpu", "--steps", "3"],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert row["precision"] == "fp32" and row["steps"] == 3
    for key in ("ddp_vs_plain_loss", "fsdp_vs_plain_loss", "ddp_vs_plain_weights", "fsdp_vs_plain_weights",
                "resumed_vs_continued_loss"):
        assert row[key] <= 1e-6, (key, row)
    assert row["not_loaded_vs_continued_loss"] > 1e-3


def test_fsdp_on_a_torch_without_fsdp2_is_refused_in_one_line(monkeypatch):
    """txl's core runs on torch >= 2.4; FSDP2 (fully_shard) became public in 2.6: an older torch gets a clear
    message naming the fix, not an ImportError from inside the trainer."""
    import torch.distributed.fsdp

    from txl import parallel
    from txl.distributed import DistInfo

    monkeypatch.delattr(torch.distributed.fsdp, "fully_shard")
    model = txl.TransformerXL(txl.ModelConfig(vocab_size=20, n_layer=1, d_model=8, n_head=2, d_head=4, d_inner=16,
                                              mem_len=2))
    with pytest.raises(ValueError, match=r"--train.parallel fsdp needs torch >= 2.6 .*use --train.parallel ddp"):
        parallel.shard(model, DistInfo(rank=0, world_size=2, device=torch.device("cpu")), precision="fp32")
