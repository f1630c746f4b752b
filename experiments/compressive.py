"""Beyond the memory's horizon at a fixed size: the Compressive Transformer's second memory (Rae et al. 2020)
against plain Transformer-XL memory with the same slots per layer, on the controlled recall corpus.

The models of ``experiments.longrange`` (3 layers, d_model 64, segment 32, the same budget and seeds), the
paper's relative encoding with recurrence, in two memories of 64 slots per layer:

* ``compressive``: memory 32 and 32 compressed slots at rate 4 (each slot 4 states; 'conv' trained by the
  attention-reconstruction loss, ``--cmem-fn``): one attention hop reaches segment + 32 + 4 x 32 = 192 tokens;
* ``plain``: memory 64: one hop reaches segment + 64 = 96 tokens.

Both are scored on the same validation answers at their training memory (``experiments.longrange.answer_scores``:
the stream read in segments, both memories carried), by distance from the definition. The question: does the
compressed model answer past the plain one's horizon? Each model's theoretical horizons (one hop: segment +
memory + rate x compressed slots; n_layer hops) are marked in the table and the plot.

Resumable (finished runs and their scores are reused; an interrupted run resumes from its checkpoint); the
results are rewritten after each run:

    nohup nice -n 10 python -m experiments.compressive --runs-dir runs/compressive --threads 1 \\
        --results runs/compressive/results > runs/compressive/log.txt 2>&1 &
    python -m experiments.compressive --runs-dir runs/compressive --report-only --results docs/results
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from experiments import common, longrange
from txl.config import RunConfig
from txl.data import Corpus, load_corpus
from txl.data.recall import RecallParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    kind: str
    """'compressive' or 'plain'."""
    mem_len: int
    cmem_len: int = 0
    cmem_rate: int = 1
    seed: int = 0
    fn: str = "conv"
    """The compression function (ModelConfig.cmem_fn)."""
    budget: int = 1
    """Times the common number of steps (a longer run: does the model learn to read its slots later?)."""

    @property
    def name(self) -> str:
        base = (f"compressive-m{self.mem_len}-c{self.cmem_len}x{self.cmem_rate}" if self.cmem_len
                else f"plain-m{self.mem_len}")
        return base + ("" if self.fn == "conv" or not self.cmem_len else f"-{self.fn}") + \
            (f"-x{self.budget}" if self.budget != 1 else "") + (f"-seed{self.seed}" if self.seed else "")

    @property
    def slots(self) -> int:
        return self.mem_len + self.cmem_len


VARIANTS = (Variant("compressive", 32, 32, 4), Variant("plain", 64), Variant("compressive", 32, 32, 4, seed=1),
            Variant("plain", 64, seed=1), Variant("compressive", 32, 32, 4, fn="max"),
            Variant("compressive", 32, 32, 4, fn="mean"), Variant("compressive", 32, 32, 4, budget=3))
"""Seed 0 of both models first, then their second seeds (seed offsets as experiments.longrange uses them), then
the two pooling functions (one seed each), then the compressive model trained three times longer (not the same
budget: whether it learns to read its slots later)."""


def horizon(*, n_layer: int, mem_len: int, tgt_len: int, cmem_len: int = 0, cmem_rate: int = 1) -> dict[str, int]:
    """The theoretical reach in tokens of a model: one layer's window (segment + memory + c x compressed slots,
    the farthest one attention hop reads) and n_layer hops of memory (the farthest a dependency can travel
    through the cached states of the layers below, Dai et al. 2019 section 3.2; Rae et al. 2020 section 3)."""
    span = mem_len + cmem_rate * cmem_len
    return {"one_hop": tgt_len + span, "n_layer_hops": n_layer * span + tgt_len}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.compressive", description=__doc__.split("\n\n")[0])
    longrange.add_arguments(p)
    p.set_defaults(out=str(common.RUNS_DIR / "compressive"))
    args = p.parse_args(argv)
    for key, value in longrange.DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.cache_dir is None:
        args.cache_dir = str(Path(args.out) / "cache" / "tokens")
    return args


def variants_of(args: argparse.Namespace) -> list[Variant]:
    return common.choose_variants(args.variants, VARIANTS)


def run_config(v: Variant, args: argparse.Namespace, vocab_size: int) -> RunConfig:
    """experiments.longrange's relative-rec run with this variant's memories: nothing else differs."""
    one = copy.copy(args)
    one.mem_len, one.steps = v.mem_len, args.steps * v.budget
    base = longrange.run_config(longrange.Variant("relative", True, v.seed), one, vocab_size)
    model = base.model.replace(mem_len=v.mem_len, cmem_len=v.cmem_len, cmem_rate=v.cmem_rate,
                               cmem_fn=v.fn)
    train = dataclasses.replace(base.train, out_dir=str(Path(args.out) / v.name))
    return base.replace(model=model, train=train)


def limits_of(v: Variant, args: argparse.Namespace) -> dict[str, int]:
    return horizon(n_layer=args.n_layer, mem_len=v.mem_len, tgt_len=args.tgt_len, cmem_len=v.cmem_len,
                   cmem_rate=v.cmem_rate)


def score_run(run_dir: Path, v: Variant, args: argparse.Namespace, corpus: Corpus, targets: np.ndarray
              ) -> dict[str, np.ndarray]:
    """Per-answer loss and hit at the training memory (both memories carried), cached in ``scores.npz``."""
    key = {"streams": args.streams, "tgt_len": args.tgt_len, "n_targets": int(targets.size),
           "targets_sum": int(targets.sum()), "valid_tokens": int(len(corpus.valid)), "mem_len": v.mem_len}
    cache, meta = run_dir / "scores.npz", run_dir / "scores.json"
    if cache.is_file() and meta.is_file() and json.loads(meta.read_text(encoding="utf-8")) == key:
        with np.load(cache) as z:
            return {k: z[k] for k in z.files}
    model = common.load_trained(run_dir, which="latest")
    start = time.perf_counter()
    nll, hit = longrange.answer_scores(model, corpus.valid, targets, mem_len=v.mem_len, seg_len=args.tgt_len,
                                       n_streams=args.streams, same_length=False)
    tmp = run_dir / "scores.partial.npz"
    np.savez(tmp, nll=nll, hit=hit)
    tmp.replace(cache)
    meta.write_text(json.dumps(key) + "\n", encoding="utf-8")
    log.info("%s scored in %.0f s", run_dir.name, time.perf_counter() - start)
    return {"nll": nll, "hit": hit}


def diagnose(run_dir: Path, v: Variant, args: argparse.Namespace, corpus: Corpus, targets: np.ndarray
             ) -> dict[str, np.ndarray]:
    """A trained compressive model read three ways at evaluation (hits per answer, cached in ``diagnosis.npz``):
    as trained; with its compressed memory dropped (cmem_len 0: memory alone); with the states it would compress
    kept uncompressed (rate 1, rate x cmem_len slots of mean-pooled single rows: a plain memory of
    mem_len + rate x cmem_len). Whether its lookup can use the far states at all, and what compression does."""
    cache = run_dir / "diagnosis.npz"
    if cache.is_file():
        with np.load(cache) as z:
            return {k: z[k] for k in z.files}
    from txl.model import TransformerXL

    model = common.load_trained(run_dir, which="latest")
    weights = {k: t for k, t in model.state_dict().items() if not k.startswith("compressor.")}
    out = {}
    for what, changes in (("no_compressed", dict(cmem_len=0)),
                          ("uncompressed", dict(cmem_len=v.cmem_rate * v.cmem_len, cmem_rate=1, cmem_fn="mean"))):
        other = TransformerXL(model.config.replace(**changes), model.compute).eval()
        other.load_state_dict(weights, strict=False)
        _, out[what] = longrange.answer_scores(other, corpus.valid, targets, mem_len=v.mem_len, seg_len=args.tgt_len,
                                               n_streams=args.streams, same_length=False)
    tmp = run_dir / "diagnosis.partial.npz"
    np.savez(tmp, **out)
    tmp.replace(cache)
    return out


def collect(args: argparse.Namespace, *, available_only: bool = False) -> tuple[dict[str, Any], np.ndarray]:
    common.set_threads(args.threads)
    corpus = load_corpus("recall", cache_dir=args.cache_dir)
    tokens = corpus.valid[:args.valid_tokens] if args.valid_tokens else corpus.valid
    corpus = dataclasses.replace(corpus, valid=tokens, test=corpus.test[:2000])
    targets, distances = longrange.scored_targets(tokens, corpus, args.streams)
    runs = {}
    for v in variants_of(args):
        run_dir = Path(args.out) / v.name
        if available_only and not ((run_dir / common.DONE_FILE).is_file() and (run_dir / "scores.npz").is_file()):
            continue
        record = common.train_or_skip(run_config(v, args, corpus.vocab_size), corpus)
        runs[v.name] = {"variant": v, "record": record, "scores": score_run(run_dir, v, args, corpus, targets)}
        if v.cmem_len and not v.seed:
            runs[v.name]["diagnosis"] = diagnose(run_dir, v, args, corpus, targets)
    return runs, distances


def report(runs: dict[str, Any], distances: np.ndarray, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    chance = 1.0 / RecallParams().n_values
    models: dict[str, list[str]] = {}
    for name in runs:
        models.setdefault(name.split("-seed")[0], []).append(name)
    by_distance, regions_out, limits = {}, {}, {}
    for model, names in models.items():
        v = runs[names[0]]["variant"]
        limits[model] = limits_of(v, args)
        per_seed = [longrange.binned(runs[n]["scores"]["hit"], distances) for n in names]
        bins = []
        for b in range(len(longrange.BINS) - 1):
            means = np.array([s[b]["mean"] for s in per_seed])
            se = float(means.std(ddof=1) / math.sqrt(len(means))) if len(means) > 1 else per_seed[0][b]["se"]
            bins.append({"lo": longrange.BINS[b], "hi": longrange.BINS[b + 1], "n": per_seed[0][b]["n"],
                         "mean": float(means.mean()), "se": se})
        nll = [longrange.binned(runs[n]["scores"]["nll"], distances) for n in names]
        by_distance[model] = {"seeds": names, "slots": v.slots, "acc": bins,
                              "nll": [float(np.mean([s[b]["mean"] for s in nll])) for b in range(len(bins))],
                              "acc_all": float(np.mean([runs[n]["scores"]["hit"].mean() for n in names])),
                              "reach": longrange.reach(bins, chance)}
    # The segment; each model's memory + segment (one hop without the compressed slots); each one-hop horizon.
    hops = {args.tgt_len + runs[names[0]]["variant"].mem_len for names in models.values()}
    edges = sorted({3, args.tgt_len, *hops, *[h["one_hop"] for h in limits.values()], 10_000})
    for model, names in models.items():
        rows = []
        for lo, hi in zip(edges, edges[1:]):
            sel = (distances >= lo) & (distances < hi)
            means = np.array([runs[n]["scores"]["hit"][sel].mean() if sel.any() else math.nan for n in names])
            m = float(means.mean())
            binomial = math.sqrt(m * (1 - m) / max(1, int(sel.sum()) * len(means)))
            se = max(float(means.std(ddof=1) / math.sqrt(len(means))), binomial) if len(means) > 1 else binomial
            rows.append({"lo": lo, "hi": hi, "n": int(sel.sum()), "acc": m, "se": se})
        regions_out[model] = rows
    payload = {"experiment": "compressive", "command": common.command_line("experiments.compressive", argv),
               "args": {k: v for k, v in vars(args).items() if k not in ("worker", "report_only")},
               "chance_accuracy": chance, "answers": int(distances.size), "bins": list(longrange.BINS),
               "horizons": limits, "by_distance": by_distance, "regions": regions_out,
               "runs": {n: {"model": r["record"]["run"]["model"], "train_s": r["record"].get("train_s"),
                            "valid_loss": r["record"].get("valid_loss")} for n, r in runs.items()}}
    headers = ["model", "slots", "seeds", "one hop", "n_layer hops",
               *[f"{b['lo']}-{b['hi'] - 1}" for b in next(iter(by_distance.values()))["acc"]], "all", "reach"]
    rows = [[m, r["slots"], len(r["seeds"]), limits[m]["one_hop"], limits[m]["n_layer_hops"],
             *[f"{100 * b['mean']:.0f} ± {100 * b['se']:.0f}" if b["n"] else "-" for b in r["acc"]],
             f"{100 * r['acc_all']:.1f}", r["reach"]] for m, r in by_distance.items()]
    md = [f"Answer accuracy (%) by distance from the definition (tokens), mean ± standard error (across seeds where "
          f"there are two, else binomial); chance {100 * chance:.2f}%; segment {args.tgt_len}, {args.n_layer} layers. "
          "Horizons: one hop = segment + memory + rate x compressed slots; n_layer hops = n_layer x (memory + rate x "
          "compressed slots) + segment.", "", common.markdown_table(headers, rows),
          "Accuracy (%) by region of distance (edges: the segment, each model's memory + segment and one-hop "
          "horizon):", "",
          common.markdown_table(["model", *[f"{r['lo']}-{r['hi'] - 1}" for r in next(iter(regions_out.values()))]],
                                [[m, *[f"{100 * r['acc']:.1f} ± {100 * r['se']:.1f}" if r["n"] else "-" for r in rows]]
                                 for m, rows in regions_out.items()])]
    diagnosis = {}
    for name, r in runs.items():
        if "diagnosis" in r:
            ways = {"as trained": r["scores"]["hit"], "compressed memory dropped": r["diagnosis"]["no_compressed"],
                    "states kept uncompressed": r["diagnosis"]["uncompressed"]}
            sels = [(distances >= lo) & (distances < hi) for lo, hi in zip(edges, edges[1:])]
            diagnosis[name] = {w: [float(hits[sel].mean()) if sel.any() else None for sel in sels]
                               for w, hits in ways.items()}
    payload["diagnosis"] = diagnosis
    if diagnosis:
        md += ["A trained compressive model read three ways at evaluation (accuracy %, same regions): as trained; "
               "its compressed memory dropped; the states it would compress kept uncompressed (a plain memory of "
               "mem + rate x compressed slots, the same weights):", "",
               common.markdown_table(["model", "read", *[f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])]],
                                     [[n, w, *[f"{100 * a:.1f}" if a is not None else "-" for a in accs]]
                                      for n, d in diagnosis.items()
                                      for w, accs in d.items()])]
    results = Path(args.results)
    common.write_results("compressive", payload, "\n".join(md), results)
    plot(payload, results / "compressive.png", args)
    return payload


def plot(payload: dict[str, Any], png: Path, args: argparse.Namespace) -> None:
    """Accuracy against distance, each model's one-hop (dotted) and n_layer-hop (dash-dot) horizons marked."""
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    for i, (model, r) in enumerate(payload["by_distance"].items()):
        color = f"C{i}"
        centers = [math.sqrt(b["lo"] * (b["hi"] - 1)) for b in r["acc"]]
        ax.errorbar(centers, [100 * b["mean"] for b in r["acc"]], yerr=[100 * b["se"] for b in r["acc"]],
                    color=color, marker="o", markersize=3, capsize=2,
                    label=f"{model} ({r['slots']} slots, {len(r['seeds'])} seed{'s' if len(r['seeds']) > 1 else ''})")
        h = payload["horizons"][model]
        ax.axvline(h["one_hop"], color=color, linestyle=":", linewidth=1.2)
        ax.axvline(h["n_layer_hops"], color=color, linestyle="-.", linewidth=0.8)
        ax.text(h["one_hop"], 100, f" one hop {h['one_hop']}", color=color, fontsize=7, va="top", rotation=90)
    ax.axhline(100 * payload["chance_accuracy"], color="k", linewidth=0.8, linestyle=":", label="chance")
    ax.axvline(args.tgt_len, color="0.5", linestyle="--", linewidth=0.8, label="segment")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("distance from the definition (tokens)")
    ax.set_ylabel("answer accuracy, %")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower left")  # the curves start high at short distances: the corner is free
    ax.set_title(f"Recall at the same slots per layer: {args.n_layer} layers, segment {args.tgt_len}\n"
                 "(dotted: one hop, dash-dot: n_layer hops)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return longrange.drive(argv, parse_args(argv), variants_of, collect, report, "compressive.md")

if __name__ == "__main__":
    raise SystemExit(main())
