"""What every experiment shares: corpora, train-or-skip, per-position losses at a fixed attention
length, and the table / JSON / plot writers.

Shape legend: S streams, L tokens per stream, T segment length, P scored positions.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from experiments import ROOT
from txl.cli.options import add_config_arguments, overrides_from, unknown_option_error
from txl.config import RunConfig
from txl.data import Corpus, load_corpus
from txl.evaluate import inference_context
from txl.model import TransformerXL
from txl.presets import apply_overrides
from txl.runtime import retain_freed_memory

log = logging.getLogger(__name__)

SHARED_DATA = ROOT.parent / "shared" / "data"
"""The shared read-only corpora (../shared/data from the repository root)."""
RUNS_DIR = ROOT / "runs"
"""Checkpoints and cached losses (git-ignored)."""
RESULTS_DIR = ROOT / "docs" / "results"
"""Tables (markdown + JSON) and plots, committed and read by docs/results.md."""
DONE_FILE = "done.json"


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def set_threads(threads: int) -> None:
    """Torch's thread count (0: its default), and freed tensor pages kept for reuse as the txl command does."""
    retain_freed_memory()
    if threads > 0:
        torch.set_num_threads(threads)


# -- data ---------------------------------------------------------------------------------------------

def load_trimmed_corpus(name: str, data_dir: str | Path, *, valid_tokens: int, test_tokens: int = 2000,
                        cache_dir: str | Path | None = None) -> Corpus:
    """A corpus whose validation split is cut to its first ``valid_tokens`` tokens (0: all of it).

    The test split is cut to ``test_tokens``: ``txl.train`` scores it once at the end, and the
    experiments report validation numbers only, as the paper's ablations do.
    """
    corpus = load_corpus(name, data_dir, cache_dir=cache_dir)
    valid = corpus.valid[:valid_tokens] if valid_tokens else corpus.valid
    return dataclasses.replace(corpus, valid=valid, test=corpus.test[:test_tokens] if test_tokens else corpus.test)


# -- training -----------------------------------------------------------------------------------------

CONFIG_SECTIONS = ["model", "compute", "optim", "train"]
"""The config sections an experiment driver takes as ``--SECTION.FIELD``, applied to every run it trains."""


def add_config_overrides(p: Any) -> None:
    """``--SECTION.FIELD VALUE`` for every model, optim and train field, as ``txl train`` takes them (the
    driver's own short flags, e.g. --n-layer, are shortcuts for some of them)."""
    add_config_arguments(p, CONFIG_SECTIONS)


def parse_known(parser: Any, argv: Sequence[str]) -> Any:
    """Parse ``argv``; an unknown option is one line naming it (a misspelt --SECTION.FIELD lists the valid
    fields), as in ``txl train``."""
    args, extra = parser.parse_known_args(list(argv))
    if extra:
        raise SystemExit(f"{parser.prog}: error: {unknown_option_error(extra, CONFIG_SECTIONS, parser.prog)}")
    return args


class Settings(argparse.Namespace):
    """A driver's flags, resolved once (shortcut options applied, unset flags at their defaults) and then
    read-only, so every run and every report reads the same values. ``config``: the ``--SECTION.FIELD``
    overrides applied to every run's config (``with_overrides``)."""

    config: dict[str, str]

    def __init__(self, **values: Any) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the driver's settings are read-only once resolved (tried to set {name}); "
                             "make a changed copy with .replace()")

    def replace(self, **changes: Any) -> Settings:
        """A copy with some settings changed (e.g. one grid worker's variants); this one is unchanged."""
        return Settings(**{**vars(self), **changes})


def resolve_settings(args: Any, shortcuts: dict[str, str], fixed: dict[str, str],
                     defaults: dict[str, Any]) -> Settings:
    """The parsed ``args`` as a driver's ``Settings`` (``args`` itself is not changed).

    The ``--SECTION.FIELD`` options are checked once. A field with a driver shortcut (``shortcuts``: flag
    attribute -> 'section.field') sets that flag, so the driver's grid logic (segment lengths, schedule)
    sees it; giving both forms with different values is an error. Fields the driver sets per run
    (``fixed``: 'section.field' -> why) are refused, naming the flag to use. Everything else goes into
    ``config``, applied to every run's config as given. Flags still unset take ``defaults``.
    """
    given = overrides_from(args)
    values = {k: v for k, v in vars(args).items() if k not in given}
    typed = apply_overrides({}, given)  # an unknown field or a bad value: the same one-line error as txl train
    for flag, dotted in shortcuts.items():
        if dotted not in given:
            continue
        section, name = dotted.split(".")
        value = typed[section][name]
        if isinstance(value, list):  # the drivers keep lists as their flags' comma-separated text
            value = ",".join(map(str, value))
        current = values.get(flag)
        if current is not None and current != value:  # shortcuts default to None until resolved
            raise SystemExit(f"--{dotted} {given[dotted]} and --{flag.replace('_', '-')} {current} disagree: "
                             "give one of them")
        values[flag] = value
        del given[dotted]
    for dotted in given:
        if dotted in fixed:
            raise SystemExit(f"--{dotted}: {fixed[dotted]}")
    for key, value in defaults.items():
        if values.get(key) is None:
            values[key] = value
    return Settings(**values, config=dict(given))


def choose_variants(text: str, grid: Sequence[Any], extra: Sequence[Any] = ()) -> list[Any]:
    """The runs ``--variants`` names: 'all' (the whole ``grid``), or comma-separated names of runs of ``grid`` and
    ``extra`` (rows trained only when named); an unknown name is refused with the known ones."""
    if text == "all":
        return list(grid)
    by_name = {v.name: v for v in (*grid, *extra)}
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in by_name]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; choose from {', '.join(by_name)}")
    return [by_name[n] for n in names]


def with_overrides(cfg: RunConfig, overrides: dict[str, str]) -> RunConfig:
    """``cfg`` with the ``--SECTION.FIELD`` overrides of the command line applied (checked again as a whole)."""
    if not overrides:
        return cfg
    return RunConfig.from_dict(apply_overrides(cfg.to_dict(), overrides))


def train_or_skip(cfg: RunConfig, corpus: Corpus) -> dict[str, Any]:
    """Train ``cfg`` unless its run directory already holds a finished run of the same config.

    A run directory with checkpoints but no ``done.json`` (an interrupted run) is resumed. The returned
    record (also ``done.json``) has the steps, the final validation loss and the wall time; ``train_s``
    is the wall time, or for a resumed run its estimate from the training log (``logged_train_seconds``).
    """
    from txl.train import train

    cfg = cfg.replace(model=cfg.model.replace(vocab_size=corpus.vocab_size))
    out = Path(cfg.train.out_dir)
    done = out / DONE_FILE
    if done.is_file():
        record = json.loads(done.read_text(encoding="utf-8"))
        if same_run(RunConfig.from_dict(record["run"]), cfg):  # fields added since: their defaults
            log.info("%s: finished earlier (%d steps, %.0f s), skipped", out, record["steps"], record["wall_s"])
            return _with_train_seconds(record, out)
        raise ValueError(f"{out} holds a finished run of another config; delete it or choose another --out")
    resume = None
    if (out / "latest.json").is_file():
        saved = RunConfig.from_dict(json.loads((out / "run.json").read_text(encoding="utf-8")))
        if not same_run(saved, cfg):
            raise ValueError(f"{out} holds an unfinished run of another config; delete it or choose another --out")
        # It goes on as it started: with the kernels it was started with (its dropout draws, among others).
        cfg = cfg.replace(compute=saved.compute)
        resume = out
        log.info("%s: resuming an interrupted run", out)
    start = time.perf_counter()
    # A directory with no checkpoint holds nothing to keep (a run killed before its first checkpoint).
    result = train(cfg, resume=resume, corpus=corpus, overwrite=resume is None)
    record = {"run": cfg.to_dict(), "steps": result.steps, "stopped": result.stopped,
              "valid_loss": result.valid.loss if result.valid else None,
              "wall_s": time.perf_counter() - start, "resumed": resume is not None,
              "n_params": sum(p.numel() for p in load_trained(out).parameters())}
    done.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return _with_train_seconds(record, out)


def same_run(saved: RunConfig, cfg: RunConfig) -> bool:
    """Whether a saved run is the run ``cfg`` describes: equal configs, except for how they are computed (the
    ``[compute]`` section), which computes the same model (so a run from before a default kernel changed is still
    the experiment's row)."""
    def strip(c: RunConfig) -> dict[str, Any]:
        d = c.to_dict()
        d.pop("compute")
        return d
    return strip(saved) == strip(cfg)


def _with_train_seconds(record: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The record with ``train_s``: its wall time, or for a resumed run the estimate from its log."""
    return {**record, "train_s": logged_train_seconds(run_dir) if record["resumed"] else record["wall_s"]}


def logged_train_seconds(run_dir: str | Path) -> float:
    """Training time of a run that was interrupted and resumed, from its metrics.jsonl: each logged
    interval's steps at that interval's measured tokens/s. Steps logged twice (done again after a
    resume from an earlier checkpoint) count once, at their last rate: the time of an uninterrupted run."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
            if line.strip()]
    by_step = {r["step"]: r for r in rows if r.get("kind") == "train" and r.get("tokens_per_s")}
    total, previous = 0.0, 0
    for step in sorted(by_step):
        r = by_step[step]
        total += (step - previous) * (r["tokens"] / step) / r["tokens_per_s"]  # interval tokens / interval rate
        previous = step
    return total


def load_trained(run_dir: str | Path, which: str = "best") -> TransformerXL:
    """The model of a run directory's ``best`` (by validation loss) checkpoint, in eval mode."""
    from txl.checkpoint import load_checkpoint

    return load_checkpoint(run_dir, which=which, with_state=False).model.eval()


# -- per-position losses at a fixed attention length ---------------------------------------------------

@torch.no_grad()
def position_losses(model: TransformerXL, tokens: np.ndarray, *, context: int, n_streams: int, seg_len: int,
                    skip: int, exact: bool = True, clamp_len: int | None = None) -> np.ndarray:
    """Loss (nats) of every scored position at attention length ``context``.

    ``tokens`` is cut into ``n_streams`` contiguous streams read in ``seg_len``-token segments with
    memory. ``exact`` (for RECL): with ``mem_len = context`` and ``same_length`` (PyTorch convention),
    query t sees the keys t - context + 1 .. t in every layer, its own included, whatever its place in
    the segment; for relative encodings the result does not depend on ``seg_len``. Not ``exact`` (the
    paper's evaluation, as in training): ``mem_len = context - seg_len`` without same_length, so the
    last query of a segment sees ``context`` keys and the first ``context - seg_len + 1``; with
    ``seg_len`` the training segment length, absolute encodings meet the query positions they were
    trained on (they number positions within the key sequence, so any other segment length moves them).
    A compressive model (Rae et al. 2020) keeps its ``cmem_len`` compressed slots, and its memory is
    ``context - seg_len - cmem_len``: the last query again sees ``context`` keys.
    The memory rows hold hidden states that were themselves computed the same way, so information can
    still reach further back through the layers (up to n_layer * context tokens): that is what
    segment-level recurrence adds, and what the paper measures.

    ``clamp_len`` (None: the model's) gives every relative distance beyond it the encoding of ``clamp_len``
    (the original evaluation's ``clamp_len``), so a model never meets a distance longer than it was trained on.

    The first ``skip`` positions of each stream are dropped (they see fewer keys); with ``skip >=
    max context - 1`` every model and context is scored on the same positions, as RECL requires.
    Returns a float64 array of length n_streams * (L - skip), stream after stream.
    """
    L = (len(tokens) - 1) // n_streams
    if L <= skip:
        raise ValueError(f"{len(tokens)} tokens in {n_streams} streams leave {L} per stream, not more than "
                         f"skip={skip}; evaluate more tokens or use fewer streams")
    data = torch.as_tensor(np.asarray(tokens[: n_streams * L + 1], dtype=np.int64))
    device = next(model.parameters()).device
    x = data[:-1].view(n_streams, L).to(device)  # (S, L)
    y = data[1:].view(n_streams, L).to(device)  # (S, L): y[:, t] follows x[:, t]
    slots = model.config.cmem_len  # a compressive model's compressed slots count among the keys of ``context``
    if not exact and context < seg_len:
        raise ValueError(f"attention length {context} is shorter than the segment ({seg_len} tokens)")
    if not exact and slots and context <= seg_len + slots:  # a compressive model keeps a memory of >= 1 row
        raise ValueError(f"attention length {context} leaves no memory beside the segment ({seg_len} tokens) and "
                         f"the {slots} compressed slots")
    if exact:
        changes = dict(mem_len=context, same_length=True, same_length_style="pytorch", ext_len=0)
    else:
        changes = dict(mem_len=context - seg_len - slots, same_length=False, ext_len=0)
    if clamp_len is not None:
        changes["clamp_len"] = clamp_len
    with inference_context(model, **changes) as attention_context:
        # As txl.evaluate: the memory rows' keys and values are carried (KVCache), not projected again.
        cache = model.start_kv_cache()
        memory, nll = None, []
        for s in range(0, L, seg_len):
            out = model(x[:, s:s + seg_len], labels=y[:, s:s + seg_len], memory=memory, kv_cache=cache,
                        context=attention_context)
            memory, cache = out.memory, out.kv_cache
            nll.append(out.nll.double().cpu())  # (S, T)
    return torch.cat(nll, dim=1)[:, skip:].reshape(-1).numpy()  # (P,)


def cached_position_losses(model: TransformerXL | None, tokens: np.ndarray, contexts: Sequence[int], cache: Path, *,
                           n_streams: int, seg_len: int, skip: int, exact: bool = True,
                           clamp_len: int | None = None) -> dict[int, np.ndarray] | None:
    """``position_losses`` for each context, cached as ``cache/c{context}.npy`` (reused while the
    evaluation setup and the tokens are unchanged). With ``model=None`` nothing is computed: the cached
    losses, or None when any context is missing (another process may still be computing them)."""
    key = {"n_streams": n_streams, "seg_len": seg_len, "skip": skip, **({} if exact else {"exact": False}),
           **({} if clamp_len is None else {"clamp_len": clamp_len}),
           "tokens_sha256": hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.int64).tobytes()).hexdigest()}
    meta = cache / "meta.json"
    current = meta.is_file() and json.loads(meta.read_text(encoding="utf-8")) == key
    if model is None:
        files = [cache / f"c{c}.npy" for c in contexts]
        return {c: np.load(f) for c, f in zip(contexts, files)} if current and all(f.is_file() for f in files) else None
    if not current:
        cache.mkdir(parents=True, exist_ok=True)
        for old in [*cache.glob("c*.npy"), *cache.glob("c*.seconds")]:
            old.unlink()
        meta.write_text(json.dumps(key, indent=2) + "\n", encoding="utf-8")
    out = {}
    for c in contexts:
        file = cache / f"c{c}.npy"
        if file.is_file():
            out[c] = np.load(file)
            continue
        start = time.perf_counter()
        out[c] = position_losses(model, tokens, context=c, n_streams=n_streams, seg_len=seg_len, skip=skip,
                                 exact=exact, clamp_len=clamp_len)
        (cache / f"c{c}.seconds").write_text(f"{time.perf_counter() - start:.3f}\n", encoding="utf-8")
        partial = cache / f"c{c}.partial.npy"
        np.save(partial, out[c])
        partial.replace(file)  # whole or absent: a report running beside this process never reads half a file
        log.info("%s/%s: context %d: loss %.4f over %d positions (%.0f s)", cache.parent.name, cache.name, c,
                 out[c].mean(), out[c].size, time.perf_counter() - start)
    return out


def eval_seconds(cache: Path, contexts: Sequence[int]) -> float:
    """Wall time spent computing the cached losses of ``contexts`` (whenever that was)."""
    files = [cache / f"c{c}.seconds" for c in contexts]
    return sum(float(f.read_text(encoding="utf-8")) for f in files if f.is_file())


# -- tables, JSON, plots ------------------------------------------------------------------------------

def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.2f}" if math.isfinite(v) else str(v)
        return str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_results(stem: str, payload: dict[str, Any], table_md: str, results_dir: Path) -> tuple[Path, Path]:
    """``results_dir/stem.json`` (everything) and ``results_dir/stem.md`` (the table)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    js, md = results_dir / f"{stem}.json", results_dir / f"{stem}.md"
    js.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    md.write_text(table_md, encoding="utf-8")
    log.info("wrote %s and %s", js, md)
    return js, md


def pyplot():
    """matplotlib's pyplot with a file-only backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_length_plot(plt: Any, fig: Any, ax: Any, png: Path, *, xlabel: str, title: str, legend_size: int = 8) -> None:
    """Finish and write a perplexity-against-attention-length plot (log2 lengths) and close it."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation perplexity")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def command_line(module: str, argv: Sequence[str]) -> str:
    """The command that reproduces a run, as the report prints it."""
    return " ".join(["python -m", module, *argv])
