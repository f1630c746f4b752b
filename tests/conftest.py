import dataclasses
import importlib.metadata
import os
import typing

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from txl.config import AttnType, ComputeConfig, ModelConfig

ATTN_TYPES: tuple[str, ...] = typing.get_args(AttnType)
"""Every attention type, from the config's Literal: a new encoding is tested everywhere this is used."""

ORACLE_VERSION = "4.37.2"  # transformers' last release whose deprecated TransfoXLLMHeadModel runs


def pytest_configure(config):
    """TXL_ORACLE=required (.ci/run's oracle environment): the oracle must be there, so no oracle test skips."""
    if os.environ.get("TXL_ORACLE") == "required" and (why := oracle_absent()):
        raise pytest.UsageError(f"TXL_ORACLE=required but the oracle transformers=={ORACLE_VERSION} {why}: "
                                "pip install -e '.[dev,oracle]'")


def oracle_absent() -> str | None:
    """Why the oracle cannot run here (None: transformers 4.37.2 is installed). Another release is absent too:
    transformers 5 has no TransfoXLLMHeadModel at all (a GPU image ships one), and later 4.x releases are not the
    reference the parity tests were proven against."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "is not installed here"
    return None if version == ORACLE_VERSION else f"is not installed here (transformers {version} is)"


def pytest_runtest_setup(item):
    """Tests marked ``oracle`` compare with transformers==4.37.2, which is not part of ``.[dev]`` (it would
    downgrade huggingface_hub and tokenizers): they skip where it is absent; .ci/run runs them in its own
    environment."""
    if item.get_closest_marker("oracle") and (why := oracle_absent()):
        pytest.skip(f"the oracle transformers=={ORACLE_VERSION} {why}; .ci/run runs the oracle tests in their "
                    "own environment (pip install -e '.[dev,oracle]', pytest -m oracle)")


@pytest.fixture(autouse=True)
def _threads(monkeypatch):
    """txl's commands pick their thread count (--threads, else OMP_NUM_THREADS, else the idle cores): in the
    suite they keep the process's count, whatever the load, and it is restored after each test."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same random state; torch's global RNG is restored afterwards."""
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    yield
    torch.random.set_rng_state(state)


@pytest.fixture
def one_thread():
    """Tiny ops gain nothing from threads and stall on a shared, busy CPU; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_dynamo():
    """Graphs compiled by another test are not reused (dynamo's cache is per process): reset before and after."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tiny_config(**overrides) -> ModelConfig:
    """The one tiny model shape of the suite (2 layers, 4 heads of 8, memory 6, no dropout): each test
    states only what it changes. A plain function, so module-level builders and parametrisations can
    call it too (``from conftest import tiny_config``)."""
    base = dict(vocab_size=61, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=64, mem_len=6, dropout=0.0)
    return ModelConfig(**{**base, **overrides})


def tiny_model(**overrides):
    """``TransformerXL`` of ``tiny_config`` with the ``overrides`` that are ComputeConfig fields (how it computes)
    given to its ComputeConfig and the others to its ModelConfig: for a test whose cases change either."""
    from txl.model import TransformerXL

    how = {f.name for f in dataclasses.fields(ComputeConfig)}
    return TransformerXL(tiny_config(**{k: v for k, v in overrides.items() if k not in how}),
                         ComputeConfig(**{k: v for k, v in overrides.items() if k in how}))


def perturbed_model(**overrides):
    """``tiny_model`` in eval mode, seeded, every weight moved away from its initialisation so every term counts."""
    torch.manual_seed(0)
    model = tiny_model(**overrides).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def assert_training_equal(fast, reference, tokens: torch.Tensor, tol: dict, grad_tol=None) -> None:
    """Train mode over three 5-token segments of ``tokens`` (B, >= 16), memory carried (it fills, then keys
    outnumber queries): per-token NLL, memory and every parameter gradient of ``fast`` equal ``reference``'s.
    ``grad_tol(want)``: the gradients' tolerance for the reference gradient ``want`` (None: ``tol``)."""
    memories = [None, None]
    for s in range(3):
        x, y = tokens[:, 5 * s:5 * s + 5], tokens[:, 5 * s + 1:5 * s + 6]
        outs = []
        for i, model in enumerate((fast.train(), reference.train())):
            model.zero_grad()
            out = model(x, labels=y, memory=memories[i])
            out.loss.backward()
            memories[i] = out.memory
            outs.append(out)
        torch.testing.assert_close(outs[0].nll, outs[1].nll, **tol)
        for a, b in zip(*memories, strict=True):
            torch.testing.assert_close(a, b, **tol)
        for (name, p), q in zip(fast.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **(tol if grad_tol is None else grad_tol(q.grad)), msg=name)


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """A small code corpus file (a path) for training runs, its token cache kept inside tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300))
    path = tmp_path / "code.txt"
    path.write_text(text)
    return str(path)


@pytest.fixture
def file_size_limit():
    """Lower this process's file-size limit for a moment: writes past it fail with a real EFBIG, through any
    writer (ours, torch's, safetensors'), the way ENOSPC reaches them. Restored afterwards."""
    import resource
    import signal

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error, not a killed process

    def limit(size):
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft if size is None else size, hard))

    yield limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, previous)


class Counting:
    """A torch.compile backend: ``inner``'s graphs, counted as they are made (``graphs``) and run (``runs``)."""

    def __init__(self, inner: str = "aot_eager") -> None:
        self.inner = torch._dynamo.lookup_backend(inner)
        self.graphs = self.runs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        compiled = self.inner(gm, example_inputs)

        def run(*args):
            self.runs += 1
            return compiled(*args)

        return run


class HostSyncs(TorchDispatchMode):
    """The ops of a region that make the host wait for the device or move host data in, by name in ``seen``.

    * a device value read on the host: ``_local_scalar_dense`` (what ``.item()``, ``int()``, ``bool()`` and
      ``.tolist()`` call), ``item``, ``is_nonzero``, ``equal``; a data-dependent shape: ``nonzero``;
    * host data made into a tensor: ``lift_fresh`` (``torch.tensor`` of Python values, a copy in on a device);
    * copies, one rule: a copy counts when it moves data from a device other than the CPU onto the CPU, whichever
      op does it (``_to_copy`` of a non-CPU tensor to ``device=cpu``: ``.cpu()``, ``.to("cpu")``; ``copy_`` into a
      CPU tensor from a non-CPU one: a copy into pinned memory). Such a copy makes the host wait for the device's
      queue (or, non-blocking, is the one a caller waits for later: counted where it is made). A copy onto a device
      does not make the host wait and is not counted. On a CPU-only run no copy counts: every tensor is on the CPU.

    A region that syncs nowhere leaves ``seen`` empty; every test that asserts so also shows the counter counting.
    """

    READS = frozenset({"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal", "aten::nonzero",
                       "aten::lift_fresh"})

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    @staticmethod
    def to_host(name: str, args, kwargs) -> bool:
        """Whether a copy op moves a non-CPU tensor onto the CPU (the rule above)."""
        def on_device(t) -> bool:
            return isinstance(t, torch.Tensor) and t.device.type != "cpu"

        if name == "aten::_to_copy":
            return on_device(args[0]) and torch.device(kwargs.get("device") or args[0].device).type == "cpu"
        if name == "aten::copy_":
            return args[0].device.type == "cpu" and on_device(args[1])
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in self.READS or self.to_host(name, args, kwargs):
            self.seen.append(name)
        return func(*args, **kwargs)
