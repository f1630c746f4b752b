"""CUDA's path on the CPU: every model path, resolved as CUDA resolves it (``txl.model.plan``), run in bf16 and fp16
under CUDA's autocast and operand rules (``txl.testing.cuda_rules``), refuses nothing; and the rules catch the
layer norm that crashed every bf16 GPU run (issue 43).

The switches are covered by a combinatorial design, not their product: ``EACH`` (fast) uses every value of every
switch at least once, ``PAIRS`` (slow) every pair of values of two switches.
"""

import dataclasses
import itertools
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ATTN_TYPES, tiny_config

import txl
from txl.config import ComputeConfig, ModelConfig, OptimConfig
from txl.data import Batch
from txl.distributed import DistInfo
from txl.evaluate import evaluate
from txl.model import casting, kernels, plan
from txl.optim import build_optimizer
from txl.testing.cuda_rules import CudaRuleError, check, cuda_autocast, cuda_rules
from txl.train import train_step

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CPU = DistInfo(rank=0, world_size=1, device=torch.device("cpu"))

FACTORS: dict[str, tuple] = {
    "attn_type": ATTN_TYPES,
    "precision": tuple(DTYPES),
    "pre_ln": (False, True),
    "div_val": (1, 4),
    "cmem_fn": (None, "conv", "mean", "max"),  # None: no compressed memory
    "same_length": (False, True),
    "dropatt": (0.0, 0.1),
    "attn_impl": ("fused", "reference"),
    "recompute_attention": (False, True),
    "dropout_impl": ("fast", "torch"),
    "cluster_rows": ("auto", "selected", "all"),
    "softmax_pad": (0, 1, 64),
    "cast_weights": ("auto", "per_use", "grouped"),
}
"""Every how-switch (``ComputeConfig``'s fields) with each of its values, 'auto' included (resolved as CUDA resolves
it), and the what-switches whose paths differ: the encoding, the precision, pre-/post-LN, the adaptive softmax's
div_val, the compressed memory and its function, same_length's mask, attention dropout."""


def valid(row: dict) -> bool:
    """Whether a (partial) row is a model the config accepts: a compressed memory refuses same_length."""
    return not (row.get("cmem_fn") and row.get("same_length"))


def config_of(row: dict) -> tuple[ModelConfig, ComputeConfig]:
    """The tiny model of a row (dropout 0.1, so the samplers run; two tail clusters), and how it computes, resolved
    for CUDA."""
    how = {f.name for f in dataclasses.fields(ComputeConfig)}
    fields = {k: v for k, v in row.items() if k not in ("precision", "cmem_fn", *how)}
    compress = dict(cmem_len=4, cmem_rate=2, cmem_fn=row["cmem_fn"]) if row.get("cmem_fn") else {}
    return (tiny_config(dropout=0.1, cutoffs=[20, 40], learned_positions=16, **compress, **fields),
            plan.resolve(ComputeConfig(**{k: v for k, v in row.items() if k in how}), "cuda"))


def each_value_design() -> list[dict]:
    """Rows in which every value of every factor appears at least once (greedy: each row takes, per factor, the
    least used value that keeps the row valid)."""
    used = {f: dict.fromkeys(values, 0) for f, values in FACTORS.items()}
    rows: list[dict] = []
    while any(0 in counts.values() for counts in used.values()):
        row: dict = {}
        for f, values in FACTORS.items():
            for value in sorted(values, key=lambda v: used[f][v]):
                if valid({**row, f: value}):
                    row[f] = value
                    break
            used[f][row[f]] += 1
        rows.append(row)
    return rows


def pairwise_design(seed: int = 0, tries: int = 40) -> list[dict]:
    """Rows in which every valid pair of values of two factors appears (greedy over seeded random candidates)."""
    rng = random.Random(seed)
    names = list(FACTORS)
    todo = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2) for x in FACTORS[a] for y in FACTORS[b]
            if valid({a: x, b: y})}
    rows = []
    while todo:
        best, gain = None, -1
        for _ in range(tries):
            (a, x), (b, y) = rng.choice(sorted(todo, key=repr))  # a row covers at least one pair still to do
            row = {f: rng.choice(FACTORS[f]) for f in names}
            row.update({a: x, b: y})
            if not valid(row):
                row["cmem_fn" if a != "cmem_fn" and b != "cmem_fn" else "same_length"] = (
                    None if a != "cmem_fn" and b != "cmem_fn" else False)
            covered = {p for p in itertools.combinations(sorted(row.items(), key=lambda kv: names.index(kv[0])), 2)}
            if len(covered & todo) > gain:
                best, gain = row, len(covered & todo)
        rows.append(best)
        todo -= set(itertools.combinations(sorted(best.items(), key=lambda kv: names.index(kv[0])), 2))
    return rows


EACH = each_value_design()
PAIRS = pairwise_design()


def row_id(row: dict) -> str:
    return "-".join(f"{v}" for v in row.values())


def model_of(row: dict) -> txl.TransformerXL:
    torch.manual_seed(0)
    return txl.TransformerXL(*config_of(row))


def train_segments(model: txl.TransformerXL, precision: str, *, steps: int = 3) -> list[float]:
    """The trainer's step (``txl.train.train_step``: autocast, backward, for fp16 the gradient scaler, clipping, Adam)
    over ``steps`` 5-token segments carrying memory (a compressive model compresses from the second)."""
    model.train()
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    tokens = torch.randint(0, 61, (2, 5 * steps + 1))
    memories, losses = [None], []
    for s in range(steps):
        batch = Batch(input_ids=tokens[:, 5 * s:5 * s + 5], labels=tokens[:, 5 * s + 1:5 * s + 6], context_len=0,
                      start=5 * s)
        stats, memories = train_step(model, optimizer, scaler, batch, memories, lr=1e-3, clip=0.25,
                                     precision=precision, info=CPU)
        losses.append(float(stats.loss))
    return losses


def run_paths(row: dict) -> set[str]:
    """Training, cached evaluation (``txl.evaluate``) and generation of a row's model under CUDA's rules; the ops
    the rules judged."""
    model = model_of(row)
    precision = row["precision"]
    with cuda_rules() as rules:
        losses = train_segments(model, precision)
        result = evaluate(model, np.arange(61 * 2, dtype=np.int64) % 61, metric="ppl", batch_size=2, tgt_len=5,
                          max_batches=3, precision=precision)
        with torch.autocast("cpu", dtype=DTYPES[precision]):
            new = txl.generate(model, torch.randint(0, 61, (2, 4)), max_new_tokens=3, temperature=0, segment_len=3)
    assert all(np.isfinite(losses)) and np.isfinite(result.loss) and new.shape == (2, 3)
    return rules.seen


def test_the_designs_cover_every_value_and_every_pair():
    for design in (EACH, PAIRS):
        for f, values in FACTORS.items():
            assert {row[f] for row in design} == set(values), f
        assert all(valid(row) for row in design)
        for row in design:
            config_of(row)  # each a model the config accepts
    pairs = {p for row in PAIRS for p in itertools.combinations(row.items(), 2)}
    for (a, b) in itertools.combinations(FACTORS, 2):
        for x, y in itertools.product(FACTORS[a], FACTORS[b]):
            assert not valid({a: x, b: y}) or ((a, x), (b, y)) in pairs, (a, x, b, y)
    assert {f.name for f in dataclasses.fields(ComputeConfig)} <= set(FACTORS)  # every how-switch is a factor
    assert len(EACH) <= 6 and len(PAIRS) < 60


@pytest.mark.parametrize("row", EACH, ids=row_id)
def test_every_switch_value_runs_cudas_path_without_a_refusal(row):
    """Each value of each switch (its 'auto' as CUDA resolves it) trains, evaluates with the key/value cache and
    generates in bf16 and fp16 under CUDA's rules; the norms, matmuls and the loss's ops were judged."""
    seen = run_paths(row)
    loss = {"nll_loss_forward"} if row["attn_impl"] != "reference" else {"gather"}  # the plain path gathers
    assert {"native_layer_norm", "native_layer_norm_backward", *loss} <= seen
    assert {"mm", "addmm", "bmm", "baddbmm"} & seen


@pytest.mark.slow
@pytest.mark.parametrize("row", PAIRS, ids=row_id)
def test_every_pair_of_switch_values_runs_cudas_path_without_a_refusal(row):
    run_paths(row)


# -- what the rules catch --------------------------------------------------------------------------------------------

def old_layer_norm(norm: torch.nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """``kernels.layer_norm`` as it was at e3c225e: autocast off only when x's dtype differs from the weight's, the
    weights not cast (with the norms out of the grouped cast, a bf16 stream reached CUDA's kernel beside float32
    weights)."""
    kind = x.device.type
    if x.dtype != norm.weight.dtype and torch.is_autocast_enabled(kind):
        with torch.autocast(kind, enabled=False):
            return norm(x)
    return norm(x)


@pytest.mark.parametrize("precision", DTYPES)
def test_the_rules_refuse_the_layer_norm_that_crashed_the_gpu(monkeypatch, precision):
    """e3c225e's layer norm, on a 16-bit stream (the adaptive embedding's projection under autocast): refused,
    naming the op, its operand dtypes and the rule, as CUDA's kernel raised "expected scalar type BFloat16 but
    found Float"; today's passes. Without the rules the CPU runs the old one happily: the bug the suite could not
    see."""
    row = dict(EACH[0], precision=precision, pre_ln=True, div_val=4)  # a projected embedding: a 16-bit stream
    monkeypatch.setattr(kernels, "layer_norm", old_layer_norm)
    monkeypatch.setattr(casting, "norm_weights", lambda modules: [])  # e3c225e's grouped cast left the norms out
    train_segments(model_of(row), precision, steps=1)  # the CPU's own kernels accept the mix
    with pytest.raises(CudaRuleError, match=rf"native_layer_norm.*input {precision_name(precision)}, weight float32"
                                            r".*CUDA's kernel takes one dtype for input, weight, bias"):
        with cuda_rules():
            train_segments(model_of(row), precision, steps=1)
    monkeypatch.undo()
    with cuda_rules():
        train_segments(model_of(row), precision, steps=1)


def precision_name(precision: str) -> str:
    return str(DTYPES[precision]).removeprefix("torch.")


@pytest.mark.parametrize("precision", DTYPES)
def test_cudas_autocast_would_silently_widen_a_norm_whose_condition_is_a_mismatch(monkeypatch, precision):
    """The trap of the obvious fix (issue 43): weights cast to the stream's dtype but autocast turned off only on a
    mismatch, so CUDA's autocast runs the norm in float32 and the stream leaves every layer float32. Under CUDA's
    autocast on the CPU the layers' outputs show it; with today's ``layer_norm`` they keep the stream's dtype."""
    dtype = DTYPES[precision]

    def mismatch_only(norm, x):
        weight, bias = norm.weight.to(x.dtype), norm.bias.to(x.dtype)
        if x.dtype != weight.dtype:
            with torch.autocast(x.device.type, enabled=False):
                return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)
        return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)

    def outputs(model):
        seen = []
        hooks = [layer.register_forward_hook(lambda m, a, out, seen=seen: seen.append(out.dtype))
                 for layer in model.layers]
        with cuda_rules(), torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            model.eval()(torch.randint(0, 61, (2, 5)))
        for h in hooks:
            h.remove()
        return seen

    row = dict(EACH[0], precision=precision, div_val=4)  # a projected embedding: a 16-bit stream
    assert outputs(model_of(row)) == [dtype, dtype]
    monkeypatch.setattr(kernels, "layer_norm", mismatch_only)
    assert outputs(model_of(row)) == [torch.float32, torch.float32]


CAUGHT = [  # (op, args, kwargs, message): one of each kind of rule
    ("mm", (torch.ones(2, 2, dtype=torch.bfloat16), torch.ones(2, 2)), {}, r"aten.mm.default: operands self bfloat16, "
     r"mat2 float32: CUDA's kernel takes one dtype for self, mat2"),
    ("baddbmm_", (torch.ones(1, 2, 2), torch.ones(1, 2, 2, dtype=torch.half), torch.ones(1, 2, 2)), {},
     r"baddbmm_.default: operands self float32, batch1 float16"),
    ("embedding", (torch.ones(4, 2), torch.tensor([1], dtype=torch.int16)), {},
     r"indices is int16: CUDA's kernel takes int64 or int32 for it"),
    ("nll_loss_forward", (torch.zeros(2, 3), torch.tensor([0, 1], dtype=torch.int32), None, 1, -100), {},
     r"target is int32: CUDA's kernel takes int64 for it"),
    ("gather", (torch.zeros(2, 3), 1, torch.zeros(2, 1, dtype=torch.int32)), {}, r"index is int32"),
    ("scatter_add", (torch.zeros(3), 0, torch.tensor([0]), torch.ones(1, dtype=torch.bfloat16)), {},
     r"operands self float32, src bfloat16"),
    ("_scaled_dot_product_flash_attention_for_cpu", (*[torch.ones(1, 1, 2, 4, dtype=torch.bfloat16)] * 3,),
     {"attn_mask": torch.zeros(1, 1, 2, 2)}, r"attn_mask is float32 beside a bfloat16 query"),
    ("native_layer_norm_backward", (torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(2, 4, dtype=torch.bfloat16),
                                    [4], torch.zeros(2, 1), torch.ones(2, 1), torch.ones(4), torch.zeros(4),
                                    [True, True, True]), {}, r"grad_out bfloat16, input bfloat16, weight float32"),
]


@pytest.mark.parametrize("op,args,kwargs,message", CAUGHT, ids=[c[0] for c in CAUGHT])
def test_each_rule_refuses_what_cudas_kernel_refuses(op, args, kwargs, message):
    func = getattr(torch.ops.aten, op).default
    with pytest.raises(CudaRuleError, match=message):
        check(func, args, kwargs)


def test_the_same_ops_in_one_dtype_pass():
    check(torch.ops.aten.mm.default, (torch.ones(2, 2, dtype=torch.bfloat16),) * 2, {})
    check(torch.ops.aten.embedding.default, (torch.ones(4, 2), torch.tensor([1])), {})
    q = torch.ones(1, 1, 2, 4, dtype=torch.bfloat16)
    for mask in (torch.ones(1, 1, 2, 2, dtype=torch.bool), torch.zeros(1, 1, 2, 2, dtype=torch.bfloat16)):
        check(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q), {"attn_mask": mask})


def test_cudas_autocast_on_the_cpu_follows_cudas_lists_and_is_undone():
    """Under it the CPU's autocast does what CUDA's does (layer norm, softmax, sums in float32; mv in 16 bits; cat
    as it is); outside it the CPU's own lists are back."""
    x, w = torch.randn(3, 8, dtype=torch.bfloat16), torch.ones(8)
    m, v = torch.randn(4, 8), torch.randn(8)

    def dtypes():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (F.layer_norm(x, (8,), w, None).dtype, torch.softmax(x, -1).dtype, x.sum().dtype,
                    torch.mv(m, v).dtype, torch.cat([x, m[:3]]).dtype)

    cpu = dtypes()
    with cuda_autocast():
        assert dtypes() == (torch.float32, torch.float32, torch.float32, torch.bfloat16, torch.float32)
    assert dtypes() == cpu == (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)


# -- the other entry points: the serve engine, the compiled decode step, export, DDP and FSDP2 ------------------------

@pytest.mark.parametrize("row", EACH, ids=row_id)
def test_the_serve_engine_reads_and_generates_on_cudas_path(row):
    """The engine's three kinds of unit (a session read, a generation's prefill and its steps) of each row's model,
    under autocast, refuse nothing (a compressive model's rows go through its own batching)."""
    from txl.serve.engine import Model, Unit

    model = model_of(row).eval()
    ids = [list(range(1, 8)), list(range(8, 15))]
    with cuda_rules() as rules, torch.autocast("cpu", dtype=DTYPES[row["precision"]]):
        engine = Model(model, segment_len=5, mem_len=6)
        read = engine.run("score", [Unit("score", x[:5], None, x[1:6]) for x in ids])
        prefill = engine.run("prefill", [Unit("prefill", x[5:6], r.memory) for x, r in zip(ids, read)])
        step = engine.run("step", [Unit("step", [3], row=p.row) for p in prefill])
    assert all(np.isfinite(r.logprobs).all() for r in read)
    assert all(torch.isfinite(s.next_log_probs).all() for s in step)
    assert "native_layer_norm" in rules.seen


@pytest.mark.slow  # torch.compile traces the step (a few seconds each)
@pytest.mark.parametrize("precision", DTYPES)
def test_the_compiled_decode_step_passes_cudas_rules(precision):
    """``txl.compiled_step`` through AOTAutograd (aot_eager), traced under CUDA's autocast: each graph it makes is
    judged op by op on its traced dtypes (torch.compile refuses to trace under a dispatch mode), and it is the graph
    that decodes (the greedy tokens of the eager step)."""
    from txl.decoding import Decoder
    from txl.testing.cuda_rules import JudgingBackend

    model = model_of(dict(EACH[0], precision=precision)).eval()
    prompt = torch.randint(0, 61, (2, 4))
    tokens = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        backend = JudgingBackend()
        with cuda_autocast(), torch.no_grad(), torch.autocast("cpu", dtype=DTYPES[precision]):
            decoder = Decoder(model, compile=compiled, backend=backend)
            log_probs, rows = decoder.run(prompt)
            picked = []
            for _ in range(3):
                picked.append(log_probs.argmax(-1))
                log_probs, rows = decoder.run(picked[-1][:, None], rows)
        tokens[compiled] = torch.stack(picked, 1)
    torch._dynamo.reset()
    assert decoder.compiled is not None and {"native_layer_norm", "mm", "embedding"} <= backend.seen
    assert torch.equal(tokens[True], tokens[False])


@pytest.mark.slow  # torch.export traces the model (seconds)
@pytest.mark.parametrize("precision", DTYPES)
@pytest.mark.parametrize("attn_type", ["relative", "rotary"])
def test_the_exported_step_runs_cudas_path_in_16_bits(attn_type, precision):
    """``txl.export``'s segment step of a 16-bit model, and of a float32 one exported and run under autocast, reads two
    segments under CUDA's rules, its state fed back as it came out (the memory leaves in the dtype it came in)."""
    from txl import export

    dtype = DTYPES[precision]
    row = dict(EACH[0], attn_type=attn_type, precision=precision)
    ids = torch.randint(0, 61, (2, 6))
    for model, autocast in ((model_of(row).eval().to(dtype), False), (model_of(row).eval(), True)):
        with cuda_autocast(), torch.autocast("cpu", dtype=dtype, enabled=autocast):
            program = export.export_program(model).module()
        memory, padding = export.initial_state(model, 2)
        with cuda_rules(), torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=autocast):
            for s in range(2):
                log_probs, memory, padding = program(ids[:, 3 * s:3 * s + 3], memory, padding)
        assert memory.dtype == next(model.parameters()).dtype and torch.isfinite(log_probs).all()


def _parallel_worker(rank: int, parallel_mode: str, precision: str, store_file: str) -> None:
    """One of two gloo processes: the trainer's wrap (DDP, or FSDP2 with CUDA's bf16 policy: ``device_type``) and
    step of a model resolved for CUDA, under CUDA's rules; a refusal fails the process."""
    import os

    import torch.distributed as dist

    from txl import parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, store=dist.FileStore(store_file, 2))
    info = DistInfo(rank=rank, world_size=2, device=torch.device("cpu"))
    model = model_of(dict(EACH[0], precision=precision, div_val=4)).train()
    step_model = parallel.wrap(model, info, parallel=parallel_mode, activation_checkpointing=False,
                               precision=precision, device_type="cuda")
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    tokens = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(rank))
    memories = [None]
    with cuda_rules():
        for s in range(2):
            batch = Batch(input_ids=tokens[:, 5 * s:5 * s + 5], labels=tokens[:, 5 * s + 1:5 * s + 6],
                          context_len=0, start=5 * s)
            stats, memories = train_step(step_model, optimizer, scaler, batch, memories, lr=1e-3, clip=0.25,
                                         precision=precision, info=info)
    assert np.isfinite(float(stats.loss))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo's teardown can abort after destroy_process_group (tests/test_scale.py); not what is tested


@pytest.mark.slow  # two spawned processes per case
@pytest.mark.parametrize("parallel_mode,precision", [("ddp", "bf16"), ("fsdp", "bf16"), ("ddp", "fp16")])
def test_ddp_and_fsdp_train_cudas_path_under_cudas_rules(parallel_mode, precision, tmp_path):
    """DDP (the layers' casts per use: 'auto' in a process group) and FSDP2 (sharded parameters; with bf16 CUDA's
    mixed-precision policy, bf16 parameters gathered) over gloo: two steps of the trainer under CUDA's rules."""
    import torch.multiprocessing as mp

    mp.start_processes(_parallel_worker, args=(parallel_mode, precision, str(tmp_path / "store")), nprocs=2,
                       start_method="spawn", join=True)
