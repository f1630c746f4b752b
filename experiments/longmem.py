"""The paper's second block again, with the relative distances clamped at the training attention length.

The ablation's recurrent models get worse as the evaluation memory grows past the training one, while the
paper's 151M model gets better (23.43 -> 23.09 at 640). One candidate cause: with a longer memory, queries
meet relative distances the model never saw in training (its attention length, memory + segment, bounds them),
whose sinusoidal encodings R(i - j) it has not learned to read. The original evaluation clamps distances
(``clamp_len``: every distance beyond it shares one encoding). This driver scores the same models, on the same
positions and with the same protocol as ``experiments.ablation`` (segments of the training length, memory
A - segment), with ``clamp_len`` = the training attention length, beside the unclamped losses the ablation
cached, so the two curves differ only in the encodings of the unseen distances.

    python -m experiments.longmem --corpus wt2 --data-dir ../shared/data/wikitext-2 --runs-dir RUNS \\
        --results docs/results --valid-tokens 60000

It trains nothing: the runs come from ``experiments.ablation``/``grid`` (recurrent runs with our encoding
that are finished); losses are cached beside each run (``losses-train-segments-clamp<C>``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from experiments import ablation, common


def add_arguments(p: argparse.ArgumentParser) -> None:
    ablation.add_arguments(p)
    p.add_argument("--clamp-len", type=int, default=0,
                   help="clamp relative distances at this length (0: each run's training attention length)")


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """{run: {"clamp_len", "unclamped": points, "clamped": points}} for every finished recurrent run with our
    encoding (points as ``ablation.long_memory``: from the training attention length on)."""
    common.set_threads(args.threads)
    grid = ablation.contexts_of(args)
    corpus = common.load_trimmed_corpus(args.corpus, args.data_dir, valid_tokens=args.valid_tokens)
    scoring = dict(n_streams=args.streams, seg_len=args.tgt_len, skip=grid[-1] - 1, exact=False)
    out = {}
    for v in ablation.variants_of(args):
        run_dir = Path(args.out) / v.name
        if not (v.recurrence and v.attn_type == "relative" and (run_dir / common.DONE_FILE).is_file()):
            continue
        init = ablation.train_attention_length(v, args)
        clamp = args.clamp_len or init
        caches = {None: run_dir / "losses-train-segments", clamp: run_dir / f"losses-train-segments-clamp{clamp}"}
        losses = {c: common.cached_position_losses(None, corpus.valid, grid, cache, clamp_len=c, **scoring)
                  for c, cache in caches.items()}
        if any(cached is None for cached in losses.values()):  # load the model only when something is left to score
            model = common.load_trained(run_dir)
            losses = {c: common.cached_position_losses(model, corpus.valid, grid, cache, clamp_len=c, **scoring)
                      for c, cache in caches.items()}
        plain, clamped = losses[None], losses[clamp]
        rows = {v.name: {"init_len": init}}
        out[v.name] = {"clamp_len": clamp, "train_attn_len": init,
                       "unclamped": ablation.long_memory({v.name: {"variant": v, "losses": plain}}, rows)[v.name],
                       "clamped": ablation.long_memory({v.name: {"variant": v, "losses": clamped}}, rows)[v.name]}
    return out


def table(runs: dict[str, Any]) -> str:
    parts = []
    for name, r in runs.items():
        rows = [[p["attn_len"], f"{p['ratio']:g}", q["ppl"], p["ppl"], f"{q['pct_vs_train_len']:+.2f}",
                 f"{p['pct_vs_train_len']:+.2f}", f"{p['gain_over_se']:.1f}"]
                for q, p in zip(r["unclamped"], r["clamped"])]
        parts += [f"`{name}` (clamp_len {r['clamp_len']}):", "", common.markdown_table(
            ["attention length", "x training", "PPL", "PPL clamped", "% vs training length",
             "% vs training length, clamped", "gain / SE, clamped"], rows)]
    return "\n".join(parts)


def plot(runs: dict[str, Any], png: Path, corpus_title: str) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (name, r) in enumerate(runs.items()):
        for key, style in (("unclamped", "--"), ("clamped", "-")):
            points = r[key]
            ax.plot([p["attn_len"] for p in points], [p["ppl"] for p in points], linestyle=style, marker="o",
                    markersize=3, color=f"C{i}", label=f"{name}, {key}" + (f" at {r['clamp_len']}" if key ==
                                                                           "clamped" else ""))
    common.save_length_plot(plt, fig, ax, png, xlabel="evaluation attention length (keys per query)",
                            title=f"{corpus_title}: longer memory, distances clamped or not", legend_size=7)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m experiments.longmem", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = ablation.parse_args(argv, p)
    common.setup_logging()
    start = time.perf_counter()
    runs = collect(args)
    if not runs:
        raise SystemExit(f"no finished recurrent run with the relative encoding in {args.out}: train the grid "
                         "first (python -m experiments.grid)")
    md = table(runs)
    payload = {"experiment": "longmem_clamp", "command": common.command_line("experiments.longmem", argv),
               "corpus": args.corpus, "valid_tokens": args.valid_tokens, "runs": runs,
               "wall_s": time.perf_counter() - start}
    name = ablation.stem("longmem_clamp", args.corpus)
    common.write_results(name, payload, md, Path(args.results))
    plot(runs, Path(args.results) / f"{name}.png", ablation.CORPUS_TITLES[args.corpus])
    print(md)
    print(json.dumps({n: r["clamped"][-1] for n, r in runs.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
