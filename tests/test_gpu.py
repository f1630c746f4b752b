"""The CUDA paths: parity, mixed precision, the key/value cache, checkpoints across devices, torch.compile.

Every test that needs a GPU is marked ``gpu`` and skipped without CUDA, so CI stays green on a CPU; on a
GPU machine run ``python -m pytest -m gpu tests/test_gpu.py``. Where a test also means something on a
CPU it is parametrized over the device and its CPU case runs everywhere (the CUDA case is then the same
test, not a copy). A 16-bit test has a third case, 'cpu-as-cuda': the same body on the CPU with the model
resolved as CUDA resolves it (``txl.model.plan``) under CUDA's autocast and operand rules
(``txl.testing.cuda_rules``), so the path a GPU runs is the path CI runs. Parity is checked with TF32 off
(``matmul_precision(tf32=False)``, torch's default): with TF32 the products keep 10 mantissa bits and 1e-5
cannot hold.
"""

import contextlib
from collections.abc import Callable

import pytest
import torch
from conftest import ATTN_TYPES, assert_training_equal, tiny_config
from hf_oracle import hf_model, ours_from_hf

import txl
import txl.train
from txl.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from txl.data import Batch, OrderedIterator
from txl.distributed import DistInfo
from txl.evaluate import autocast
from txl.model import plan
from txl.optim import build_optimizer
from txl.runtime import compile_model, matmul_precision
from txl.testing.cuda_rules import cuda_rules
from txl.train import train_step

HAS_CUDA = torch.cuda.is_available()
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
CUDA = pytest.param("cuda", marks=ON_GPU, id="cuda")
BOTH = [pytest.param("cpu", id="cpu"), CUDA]
AS_CUDA = "cpu-as-cuda"
"""The CUDA case's twin on the CPU: the model resolved for CUDA, the body under CUDA's rules."""
THREE = [*BOTH, pytest.param(AS_CUDA, id=AS_CUDA)]
TOL = dict(atol=1e-5, rtol=1e-5)


def where(device: str) -> tuple[torch.device, str, Callable[[], contextlib.AbstractContextManager]]:
    """The torch device a case runs on, the device type its model is resolved for, and the rules it runs under
    (a context manager each call)."""
    if device == AS_CUDA:
        return torch.device("cpu"), "cuda", cuda_rules
    return torch.device(device), device, contextlib.nullcontext


def model_on(config: txl.ModelConfig, device: str, compute: txl.ComputeConfig | None = None) -> txl.TransformerXL:
    """``config``'s model on the case's device, computed as the device it stands for resolves ``compute``."""
    dev, kind, _ = where(device)
    return txl.TransformerXL(config, plan.resolve(compute or txl.ComputeConfig(), kind)).to(dev)


@pytest.fixture
def exact():
    """fp32 products on every device for the test (TF32 off), restored afterwards."""
    with matmul_precision(torch.device("cuda"), tf32=False):
        yield


def tiny(**changes) -> txl.ModelConfig:
    """The suite's tiny model with two adaptive clusters (the device path of the adaptive softmax)."""
    return tiny_config(**{"cutoffs": [20, 40], "div_val": 2, **changes})


@pytest.mark.oracle
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("overrides", [dict(), dict(same_length=True, clamp_len=4), dict(div_val=2, d_embed=48,
                                                                                        cutoffs=[30])],
                         ids=["div1", "same_length_clamp", "div2"])
def test_hf_parity_on_cuda(exact, overrides):
    """Per-token NLL, log-probabilities and memories equal the Hugging Face reference on the GPU (fp32, TF32 off)."""
    if "d_embed" in overrides:
        overrides = dict(overrides, tie_projs=[True, True])
    hf = hf_model(**overrides).cuda()
    ours = ours_from_hf(hf.cpu()).cuda()
    hf.cuda()
    cfg = ours.config
    tokens = torch.randint(0, cfg.vocab_size, (3, 3 * 7 + 1), device="cuda")
    memory, hf_mems = ours.init_memory(3, cfg.mem_len), None
    with torch.no_grad():
        for s in range(3):
            x, y = tokens[:, s * 7:(s + 1) * 7], tokens[:, s * 7 + 1:(s + 1) * 7 + 1]
            ref = hf(input_ids=x, mems=hf_mems)
            ref_nll = hf(input_ids=x, mems=hf_mems, labels=x).losses  # (B, T-1): shifted inside
            out = ours(x, labels=y, memory=memory, return_log_probs=True)
            torch.testing.assert_close(out.log_probs, ref.prediction_scores, **TOL)
            torch.testing.assert_close(out.nll[:, :-1], ref_nll, **TOL)
            for ours_m, hf_m in zip(out.memory, ref.mems, strict=True):
                torch.testing.assert_close(ours_m, hf_m.transpose(0, 1), **TOL)
            memory, hf_mems = out.memory, ref.mems




def kernel_pair(attn_type: str, device: str, **changes) -> tuple[txl.TransformerXL, txl.TransformerXL]:
    """The default attention kernel and the reference path (``compute.attn_impl``) with the same perturbed weights."""
    config = tiny_config(**{**dict(vocab_size=50, attn_type=attn_type, learned_positions=16), **changes})
    torch.manual_seed(0)
    fast = model_on(config, device)
    with torch.no_grad():
        for p in fast.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    reference = model_on(config, device, txl.ComputeConfig(attn_impl="reference"))
    reference.load_state_dict(fast.state_dict())
    return fast, reference


@pytest.mark.parametrize("device", [CUDA, pytest.param(AS_CUDA, id=AS_CUDA)])  # plain CPU: tests/test_kernels.py
@pytest.mark.parametrize("context", [dict(), dict(same_length=True, clamp_len=3)], ids=["plain", "same_length_clamp"])
@pytest.mark.parametrize("attn_type", ATTN_TYPES)
def test_cuda_kernels_equal_the_reference(attn_type, context, device, exact):
    """On the GPU, fp32 with TF32 off: loss, memory and every gradient of the default kernel equal the reference
    over three segments (the memory fills, then keys outnumber queries); under bf16 autocast the losses agree
    within 1e-2."""
    dev, _, rules = where(device)
    fast, reference = kernel_pair(attn_type, device, **context)
    tokens = torch.randint(0, 50, (2, 16), device=dev)
    with rules():
        assert_training_equal(fast, reference, tokens, TOL)
        with torch.no_grad():
            fp32 = reference(tokens[:, :5], labels=tokens[:, 1:6]).loss.item()
            with autocast(dev, "bf16"):
                bf16 = [model(tokens[:, :5], labels=tokens[:, 1:6]).loss.item() for model in (fast, reference)]
    assert all(abs(loss - fp32) < 1e-2 for loss in bf16), (bf16, fp32)


@pytest.mark.parametrize("device", BOTH)
def test_kv_cache_generation_equals_uncached(device, exact):
    """Greedy generation with memory and key/value cache equals recomputing the whole context per token."""
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny()).to(device).eval()
    prompt = torch.randint(0, 61, (2, 11), device=device)
    new = txl.generate(model, prompt, max_new_tokens=6, temperature=0, segment_len=4)  # (2, 6)
    ids = prompt
    with torch.no_grad():
        for _ in range(6):
            nxt = model(ids, return_log_probs=True).log_probs[:, -1].argmax(-1)  # (2,) one pass over everything
            ids = torch.cat([ids, nxt[:, None]], dim=1)
    assert new.device.type == device and torch.equal(new, ids[:, 11:])


@pytest.mark.parametrize("device", BOTH)
def test_kv_cache_segment_equals_uncached_segment(device, exact):
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny()).to(device).eval()
    x = torch.randint(0, 61, (2, 16), device=device)
    with torch.no_grad():
        first = model(x[:, :8], kv_cache=txl.KVCache())
        cached = model(x[:, 8:], memory=first.memory, kv_cache=first.kv_cache, return_log_probs=True)
        plain = model(x[:, 8:], memory=first.memory, return_log_probs=True)
    torch.testing.assert_close(cached.log_probs, plain.log_probs, **TOL)


@pytest.mark.parametrize("device,precision", [pytest.param("cpu", "bf16", id="cpu-bf16"),
                                              pytest.param("cuda", "bf16", marks=ON_GPU, id="cuda-bf16"),
                                              pytest.param("cuda", "fp16", marks=ON_GPU, id="cuda-fp16"),
                                              pytest.param(AS_CUDA, "bf16", marks=pytest.mark.slow,
                                                           id=f"{AS_CUDA}-bf16"),
                                              pytest.param(AS_CUDA, "fp16", marks=pytest.mark.slow,
                                                           id=f"{AS_CUDA}-fp16")])
def test_mixed_precision_training_decreases_the_loss(device, precision, one_thread):
    """The trainer's step (autocast, and for fp16 the gradient scaler) learns a tiny repeating corpus."""
    torch.manual_seed(0)
    dev, _, rules = where(device)
    model = model_on(tiny(cutoffs=[], div_val=1), device).train()
    optimizer = build_optimizer(model, OptimConfig(lr=3e-3))
    scaler = torch.amp.GradScaler(dev.type, enabled=precision == "fp16")
    info = DistInfo(rank=0, world_size=1, device=dev)
    text = torch.arange(12).repeat(2, 8).to(dev)  # (2, 96): a period-12 pattern in both streams
    memories, losses = [None], []
    for step in range(40):
        lo = (step * 8) % 88
        batch = Batch(input_ids=text[:, lo:lo + 8], labels=text[:, lo + 1:lo + 9], context_len=0, start=lo)
        with rules():
            stats, memories = train_step(model, optimizer, scaler, batch, memories, lr=3e-3, clip=0.25,
                                         precision=precision, info=info)
        losses.append(float(stats.loss))  # a device scalar until read
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    if precision == "fp16":
        assert scaler.get_scale() > 0  # the scaler ran (and did not collapse)


@pytest.mark.parametrize("device", THREE)
def test_bf16_autocast_loss_is_close_to_fp32(device, exact):
    torch.manual_seed(0)
    dev, _, rules = where(device)
    model = model_on(tiny(), device).eval()
    x = torch.randint(0, 61, (2, 9), device=dev)
    with rules(), torch.no_grad():
        fp32 = model(x[:, :-1], labels=x[:, 1:]).loss
        with autocast(dev, "bf16"):
            bf16 = model(x[:, :-1], labels=x[:, 1:]).loss
    assert abs(bf16.item() - fp32.item()) < 1e-2


@pytest.mark.parametrize("device", THREE)
def test_the_residual_stream_and_memory_keep_the_parameters_dtype_under_autocast(device, exact):
    """Under bf16 autocast the hidden states between the layers and the memory stay float32 on every device (issue 45
    removed residual_dtype and state_dtype: no GPU win measured), autocast rounding only inside its ops; the loss
    within bf16 rounding of fp32."""
    torch.manual_seed(0)
    dev, kind, rules = where(device)
    # div_val 1: the embedding is a float32 lookup (div_val > 1 projects it, and autocast's matmul gives bf16)
    model = model_on(tiny(div_val=1), device).eval()
    x = torch.randint(0, 61, (2, 17), device=dev)
    with rules(), torch.no_grad():
        fp32 = model(x[:, 8:-1], labels=x[:, 9:], memory=model(x[:, :8]).memory).loss
        with autocast(dev, "bf16"):
            first = model(x[:, :8])
            out = model(x[:, 8:-1], labels=x[:, 9:], memory=first.memory)
    assert out.hidden.dtype == torch.float32
    assert all(m.dtype == torch.float32 for m in out.memory)
    assert abs(out.loss.item() - fp32.item()) < 1e-2


@pytest.mark.parametrize("device", BOTH)
def test_checkpoint_written_on_the_device_loads_on_cpu(device, tmp_path, exact):
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny()).to(device).eval()
    x = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        ref = model(x[:, :-1].to(device), labels=x[:, 1:].to(device), return_log_probs=True)
    txl.save_pretrained(model, tmp_path / "m")
    loaded = txl.from_pretrained(tmp_path / "m", device="cpu")
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    with torch.no_grad():
        out = loaded(x[:, :-1], labels=x[:, 1:], return_log_probs=True)
    torch.testing.assert_close(out.log_probs, ref.log_probs.cpu(), **TOL)
    torch.testing.assert_close(out.nll, ref.nll.cpu(), **TOL)


@pytest.mark.parametrize("device", BOTH)
def test_batches_reach_the_device_with_the_same_tokens(device):
    """The iterator's batches (pinned and copied without blocking on CUDA) hold the stream's tokens."""
    import numpy as np

    tokens = np.arange(100, dtype=np.int64)
    it = OrderedIterator(tokens, batch_size=2, tgt_len=8, device=device)
    first = next(iter(it))
    assert first.input_ids.device.type == device
    assert first.input_ids.cpu().tolist() == [list(range(0, 8)), list(range(50, 58))]
    assert first.labels.cpu().tolist() == [list(range(1, 9)), list(range(51, 59))]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_compiled_equals_eager_on_cuda(exact):
    """torch.compile of the model gives the eager loss and gradients (fp32, TF32 off) on the GPU."""
    torch.manual_seed(0)
    model = txl.TransformerXL(tiny()).cuda().train()
    x = torch.randint(0, 61, (2, 17), device="cuda")
    eager = model(x[:, :8], labels=x[:, 1:9])
    eager.loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    compiled = compile_model(model)(x[:, :8], labels=x[:, 1:9])
    compiled.loss.backward()
    torch.testing.assert_close(compiled.loss, eager.loss, **TOL)
    for g, p in zip(grads, (p for p in model.parameters() if p.grad is not None), strict=True):
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-4)


# The test loss after 30 steps of the body below, calibrated on a CPU run of it (issue 34): 5.3695 with
# precision bf16 (the H200 gave 5.3695 too), fp32 5.34 to 5.39 over seeds 0 to 2 (bf16 the same to 1e-4);
# uniform over 256 bytes is ln 256 = 5.545. The bound asks for learning beyond the spread of the seeds.
AUTO_PRECISION_BOUND = 5.45


@pytest.mark.parametrize("device", [*BOTH, pytest.param(AS_CUDA, marks=pytest.mark.slow, id=AS_CUDA)])
def test_training_run_with_auto_precision(device, tmp_path):
    """txl.train end to end: precision 'auto' (bf16 on a GPU that has it, fp32 on a CPU) learns within the
    calibrated bound; on a GPU TF32 is on for the run and off after. The CPU case is the GPU test's twin; the
    cpu-as-cuda case runs what 'auto' is on CUDA (bf16, the model resolved for CUDA) under CUDA's rules."""
    from txl.data.corpora import load_run_corpus

    dev, kind, rules = where(device)
    text = tmp_path / "code.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300)))
    cfg = RunConfig(data=DataConfig(corpus=str(text), level="byte"),
                    model=tiny(cutoffs=[], div_val=1, vocab_size=256), compute=plan.resolve(txl.ComputeConfig(), kind),
                    train=TrainConfig(out_dir=str(tmp_path / "run"), max_steps=30, batch_size=4, tgt_len=16,
                                      progress=False, tensorboard=False, plot=False, eval_batches=2,
                                      eval_interval=0, device=dev.type,
                                      precision=plan.resolve_precision("auto", kind)))
    with rules():
        result = txl.train.train(cfg, corpus=load_run_corpus(cfg.data))
    assert result.steps == 30 and result.test.loss < AUTO_PRECISION_BOUND
    if device == "cuda":
        assert torch.backends.cuda.matmul.allow_tf32 is False  # restored after the run
