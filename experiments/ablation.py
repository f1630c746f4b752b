"""The paper's Table 6 at small scale: segment-level recurrence x positional encoding x loss, on PTB words
or WikiText-2 (``--corpus ptb|wt2``).

Every run of a corpus has one fixed budget (the same model size, steps, batch and segment length):
recurrence on (mem_len = --mem-len) and off (mem_len 0), crossed with the paper's relative encoding
('relative'), Shaw et al. 2018 ('shaw'), Vaswani et al. 2017 absolute sinusoids ('absolute') and
Al-Rfou et al. 2018 learned absolute positions ('al_rfou'), and with the loss on every position of a
training segment ('Full') or on its last half only ('Half', ``train.loss_positions='last_half'``).
PTB runs the eight Full rows; WikiText-2 (long articles) runs the nine rows of the paper's first block,
the Full Vaswani / Al-Rfou rows for context, and a second seed of the main row to measure the noise
(``GRIDS``, in the order they answer the main question).

Every trained model is then scored on the same validation positions with attention lengths A from
--contexts, evaluated as the paper does and as it was trained: segments of --tgt-len tokens with a
memory of A - tgt_len, so the last query of a segment sees A keys (``common.position_losses``, not
exact). The absolute encodings number positions within the key sequence, so only the training segment
length shows them the positions they were trained on. (RECL, ``experiments.recl``, scores the same
models with every query seeing exactly A keys instead.) Reported, as in the paper:

* PPL init: perplexity at the training attention length, the most keys a query saw in training
  (mem_len + tgt_len with recurrence, tgt_len without);
* PPL best: the best perplexity over attention lengths >= the training one, and the shortest
  length that reaches it (Attn Len).

    python -m experiments.ablation                              # PTB, the full budget (about 2.5 h on one core)
    python -m experiments.ablation --corpus wt2 --runs-dir /work/txl-runs/wt2    # WikiText-2 (see its plan)
    python -m experiments.ablation --steps 2 --valid-tokens 600 --contexts 8,16 ...   # a smoke test
    python -m experiments.ablation --corpus wt2 --model.dropatt 0.1 --optim.weight_decay 0.01   # any field

The short flags are shortcuts for config fields (``--n-layer`` is ``--model.n_layer``, ``--steps`` is
``--train.max_steps``); every other model, optim and train field is set as ``txl train`` sets it,
``--SECTION.FIELD VALUE``, for every run of the grid. The fields the grid varies (the encoding, the loss
positions, the run directory) are refused.

Finished runs (``<runs-dir>/<name>/done.json``) and computed losses are reused, so the command
can be interrupted and rerun; results/ablation[_wt2].{json,md,png} are rewritten from them.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from experiments import common, paper
from txl.config import DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from txl.model.attention import attn_types, encoding

log = logging.getLogger(__name__)

ENCODINGS = ("relative", "shaw", "absolute", "al_rfou")
"""The encodings of the paper's Table 6, the grid's rows (an encoding's name and traits: txl.model.encoding)."""
SIGNIFICANCE = 2.0
"""A model 'improves with longer attention' when its mean per-position loss at the best length is below
the one at the training length by more than SIGNIFICANCE standard errors of the paired difference
(positions of running text are correlated, so this is optimistic; it still filters pure noise)."""


@dataclass(frozen=True)
class Variant:
    attn_type: str
    recurrence: bool
    loss: str = "Full"
    """'Full' (every segment position) or 'Half' (the last half only), the paper's Loss column."""
    seed: int = 0
    """Added to --seed: a second seed of the same row measures run-to-run noise."""
    cmem_len: int = 0
    """Compressed memory slots per layer (Rae et al. 2020; ``experiments.compressive``), taken out of --mem-len so
    the row holds the same number of memory slots as the plain row: memory mem_len - cmem_len + cmem_len slots."""
    cmem_rate: int = 4
    cmem_fn: str = "conv"

    @property
    def name(self) -> str:
        return (f"{self.attn_type}-{'rec' if self.recurrence else 'norec'}" + ("-half" if self.loss == "Half" else "")
                + (f"-c{self.cmem_len}x{self.cmem_rate}" + ("" if self.cmem_fn == "conv" else f"-{self.cmem_fn}")
                   if self.cmem_len else "")
                + (f"-seed{self.seed}" if self.seed else ""))

    def mem_len(self, args: argparse.Namespace) -> int:
        """The plain memory of this row at training: --mem-len less the compressed slots, 0 without recurrence."""
        return args.mem_len - self.cmem_len if self.recurrence else 0


VARIANTS = tuple(Variant(a, r) for r in (True, False) for a in ENCODINGS)
"""The PTB grid: every encoding with and without recurrence, Full loss."""

WT2_VARIANTS = (
    # The main question first: ours with recurrence against Shaw's with recurrence and ours without; then the
    # seed noise, then the Half rows; the rest of the paper's first block; then the Full Transformers for context.
    Variant("relative", True), Variant("shaw", True), Variant("relative", False), Variant("relative", True, seed=1),
    Variant("relative", True, "Half"), Variant("relative", False, "Half"), Variant("shaw", False),
    Variant("shaw", False, "Half"), Variant("absolute", False, "Half"), Variant("al_rfou", False, "Half"),
    Variant("absolute", False), Variant("al_rfou", False),
)
"""The WikiText-2 grid, in priority order: the paper's nine first-block rows, two Full rows, a second seed."""

GRIDS = {"ptb": VARIANTS, "wt2": WT2_VARIANTS}
EXTRA_VARIANTS = {"wt2": (Variant("rotary", True), Variant("relative", True, cmem_len=32),
                          Variant("relative", True, cmem_len=32, seed=1))}
"""Rows beside the paper's, trained only when named in --variants (``experiments.rotary``,
``experiments.compressive --corpus wt2``): not part of the grid's ``all``, its table or its RECL group."""

CORPUS_DEFAULTS: dict[str, dict[str, Any]] = {
    "ptb": {"data_dir": str(common.SHARED_DATA / "ptb"), "out": str(common.RUNS_DIR / "ablation"),
            "steps": 12000, "batch_size": 16, "tgt_len": 32, "mem_len": 32, "n_layer": 3, "d_model": 128,
            "n_head": 4, "d_inner": 512, "dropout": 0.1, "cutoffs": "2000,6000",
            "contexts": "32,64,96,128,160,192,224,256", "eval_seg_len": 64, "checkpoints": 4,
            "lr": 1e-3, "seed": 0, "minutes_per_run": 0.0},
    "wt2": {"data_dir": str(common.SHARED_DATA / "wikitext-2"), "out": str(common.RUNS_DIR / "ablation-wt2"),
            "steps": 4000, "batch_size": 16, "tgt_len": 64, "mem_len": 64, "n_layer": 3, "d_model": 128,
            "n_head": 4, "d_inner": 512, "dropout": 0.1, "cutoffs": "2000,10000",
            "contexts": "64,128,192,256,384,512,768,1024", "eval_seg_len": 128, "checkpoints": 20,
            "lr": 1e-3, "seed": 0, "minutes_per_run": 0.0},
}
"""Each corpus's full budget: the defaults of the flags left unset. PTB's are the runs in docs/results.md;
WikiText-2's are sized in its plan (docs/results.md, 'WikiText-2'). ``checkpoints`` per run bound the
work an interruption loses (WikiText-2 runs are long and run in the background)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of the ablation runs (shared by experiments.recl, which reuses the same models). Flags
    whose default depends on --corpus default to None here; ``resolve`` fills them from CORPUS_DEFAULTS."""
    p.add_argument("--corpus", choices=sorted(CORPUS_DEFAULTS), default="ptb",
                   help="ptb (short news sentences) or wt2 (WikiText-2, long articles); sets the defaults below")
    g = p.add_argument_group("budget (identical for every run; defaults per corpus)")
    g.add_argument("--steps", type=int, help="optimiser steps per run (the budget)")
    g.add_argument("--minutes-per-run", type=float,
                   help="also stop a run after this many minutes (0: no limit; steps are the budget)")
    g.add_argument("--batch-size", type=int)
    g.add_argument("--tgt-len", type=int, help="training segment length")
    g.add_argument("--mem-len", type=int, help="training memory length of the recurrent runs")
    g.add_argument("--lr", type=float)
    g.add_argument("--seed", type=int)
    m = p.add_argument_group("model (defaults per corpus)")
    m.add_argument("--n-layer", type=int)
    m.add_argument("--d-model", type=int)
    m.add_argument("--n-head", type=int)
    m.add_argument("--d-inner", type=int)
    m.add_argument("--dropout", type=float)
    m.add_argument("--cutoffs", help="adaptive softmax clusters (cheaper output layer on CPU); empty: a full softmax")
    e = p.add_argument_group("data and evaluation")
    e.add_argument("--data-dir", help="folder of the corpus files (default: ../shared/data/ptb or wikitext-2)")
    e.add_argument("--valid-tokens", type=int, default=0, help="score the first N validation tokens (0: all)")
    e.add_argument("--contexts", help="evaluation attention lengths, increasing; must include the training ones")
    e.add_argument("--streams", type=int, default=8, help="parallel evaluation streams")
    e.add_argument("--eval-seg-len", type=int,
                   help="segment length of RECL's exact scoring (no effect on relative encodings' losses); "
                   "the ablation table reads --tgt-len segments")
    e.add_argument("--variants", default="all", help="comma-separated run names (e.g. relative-rec), or all")
    p.add_argument("--out", "--runs-dir", dest="out", help="run directories go here (default: runs/ablation, "
                   "runs/ablation-wt2); a folder outside the checkout keeps long runs safe")
    p.add_argument("--results", default=str(common.RESULTS_DIR), help="tables and plots go here")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    common.add_config_overrides(p)


SHORTCUTS = {"steps": "train.max_steps", "minutes_per_run": "train.minutes", "batch_size": "train.batch_size",
             "tgt_len": "train.tgt_len", "mem_len": "model.mem_len", "lr": "optim.lr", "seed": "train.seed",
             "n_layer": "model.n_layer", "d_model": "model.d_model", "n_head": "model.n_head",
             "d_inner": "model.d_inner", "dropout": "model.dropout", "cutoffs": "model.cutoffs"}
"""The ablation's short flags, each a shortcut for a config field (``--n-layer`` is ``--model.n_layer``)."""

FIXED = {"model.attn_type": "each run's encoding is its variant's; choose runs with --variants",
         "train.loss_positions": "each run's loss (Full or Half) is its variant's; choose runs with --variants",
         "train.out_dir": "each run's directory is <--runs-dir>/<variant name>; give --runs-dir",
         "model.vocab_size": "the corpus sets it"}
"""Fields the grid sets per run: an override of one would make the variants the same run."""


def resolve(args: argparse.Namespace) -> common.Settings:
    """The settings of ``args``: the ``--SECTION.FIELD`` options taken (``common.resolve_settings``) and every
    flag left unset taken from its corpus's full budget (CORPUS_DEFAULTS)."""
    return common.resolve_settings(args, SHORTCUTS, FIXED, CORPUS_DEFAULTS[args.corpus])


def parse_args(argv: list[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The ablation's flags (on ``parser`` when given, e.g. with RECL's extra ones), resolved per corpus."""
    if parser is None:
        parser = argparse.ArgumentParser(prog="python -m experiments.ablation", description=__doc__.split("\n\n")[0])
        add_arguments(parser)
    return resolve(common.parse_known(parser, argv))


def parse_extra_rows(argv: list[str], parser: argparse.ArgumentParser, rows: str) -> argparse.Namespace:
    """``parse_args`` for a driver of rows defined in ``EXTRA_VARIANTS`` (the rotary row, the compressed rows):
    a corpus without them is refused in one line naming ``rows`` (e.g. 'the rotary row is')."""
    args = parse_args(argv, parser)
    if args.corpus not in EXTRA_VARIANTS:
        raise SystemExit(f"--corpus {args.corpus}: {rows} defined for {', '.join(EXTRA_VARIANTS)}")
    return args


def defaults(corpus: str) -> dict[str, Any]:
    """Every flag's value in the full budget of ``corpus`` (what the report calls 'not reduced')."""
    return vars(parse_args(["--corpus", corpus]))


def stem(base: str, corpus: str) -> str:
    """Result file stem: PTB keeps the plain names (ablation, recl), other corpora add theirs (ablation_wt2)."""
    return base if corpus == "ptb" else f"{base}_{corpus}"


def contexts_of(args: argparse.Namespace) -> list[int]:
    grid = [int(c) for c in args.contexts.split(",") if c.strip()]
    if grid != sorted(set(grid)) or grid[0] < 1:
        raise SystemExit(f"--contexts {args.contexts}: give strictly increasing positive lengths")
    for need in (args.tgt_len, args.tgt_len + args.mem_len):
        if need not in grid:
            raise SystemExit(f"--contexts {args.contexts} lacks {need}, a training attention length "
                             f"(tgt_len={args.tgt_len}, mem_len + tgt_len={args.tgt_len + args.mem_len})")
    return grid


def variants_of(args: argparse.Namespace) -> list[Variant]:
    return common.choose_variants(args.variants, GRIDS[args.corpus], EXTRA_VARIANTS.get(args.corpus, ()))


def train_attention_length(v: Variant, args: argparse.Namespace) -> int:
    """The most keys a query attends to in training: memory + segment, or the segment alone."""
    return args.tgt_len + (args.mem_len if v.recurrence else 0)


def run_config(v: Variant, args: argparse.Namespace, vocab_size: int) -> RunConfig:
    """One run of the ablation: only attn_type, mem_len, the loss positions and the seed differ between runs."""
    max_len = max(contexts_of(args)) + args.eval_seg_len  # keys per evaluation forward
    model = ModelConfig(vocab_size=vocab_size, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                        d_inner=args.d_inner, dropout=args.dropout, dropatt=0.0, attn_type=v.attn_type,
                        cutoffs=[int(c) for c in args.cutoffs.split(",") if c.strip()],
                        mem_len=v.mem_len(args), cmem_len=v.cmem_len, cmem_rate=v.cmem_rate,
                        cmem_fn=v.cmem_fn,  # type: ignore[arg-type]
                        learned_positions=max(512, max_len))  # longer-than-trained rows stay untrained
    checkpoints = CORPUS_DEFAULTS[args.corpus]["checkpoints"]
    return common.with_overrides(RunConfig(
        data=DataConfig(corpus=args.corpus, data_dir=str(Path(args.data_dir).resolve())),  # one name per folder
        model=model,
        optim=OptimConfig(lr=args.lr, min_lr=args.lr / 100, schedule="cosine",
                          warmup_steps=max(1, args.steps // 20), clip=0.25),
        train=TrainConfig(out_dir=str(Path(args.out) / v.name), max_steps=args.steps,
                          minutes=args.minutes_per_run, batch_size=args.batch_size, tgt_len=args.tgt_len,
                          seed=args.seed + v.seed, device="cpu", precision="fp32", eval_interval=0,
                          ckpt_interval=max(1, args.steps // checkpoints),
                          loss_positions="last_half" if v.loss == "Half" else "all",
                          keep_last=1, log_interval=max(1, args.steps // 50), tensorboard=False, plot=True,
                          progress=False)), args.config)


def collect(args: argparse.Namespace, *, exact: bool = False, available_only: bool = False) -> dict[str, Any]:
    """Train (or reuse) every variant and score it at every context: {name: {record, losses}}.

    Not ``exact`` (this table): the paper's evaluation, segments of the training length and memory
    context - tgt_len, so PPL init is measured exactly as the model was trained. ``exact`` (RECL): every
    query sees exactly ``context`` keys (``common.position_losses``). ``available_only``: neither train
    nor score; only the runs that are finished and scored at every context (a report of a grid that
    other processes are still running).
    """
    common.set_threads(args.threads)
    grid = contexts_of(args)
    corpus = common.load_trimmed_corpus(args.corpus, args.data_dir, valid_tokens=args.valid_tokens)
    seg_len, name = (args.eval_seg_len, "losses") if exact else (args.tgt_len, "losses-train-segments")
    runs = {}
    for v in variants_of(args):
        run_dir = Path(args.out) / v.name
        if available_only and not (run_dir / common.DONE_FILE).is_file():
            continue
        record = common.train_or_skip(run_config(v, args, corpus.vocab_size), corpus)
        # A compressive row's compressed slots are keys too: it is scored where they leave room for a memory.
        contexts = [c for c in grid if c > seg_len + v.cmem_len] if v.cmem_len else grid
        losses = common.cached_position_losses(None if available_only else common.load_trained(run_dir),
                                               corpus.valid, contexts, run_dir / name, n_streams=args.streams,
                                               seg_len=seg_len, skip=grid[-1] - 1, exact=exact)
        if losses is None:
            continue
        runs[v.name] = {"variant": v, "record": record, "losses": losses,
                        "eval_wall_s": common.eval_seconds(run_dir / name, grid)}
    return runs


def standard_error(diff: np.ndarray) -> float:
    """Standard error of the mean of paired per-position differences (inf for fewer than two)."""
    return float(np.std(diff, ddof=1) / math.sqrt(diff.size)) if diff.size > 1 else math.inf


def summarise(v: Variant, losses: dict[int, np.ndarray], args: argparse.Namespace) -> dict[str, Any]:
    """PPL at every context, PPL init, PPL best (over contexts >= the training one) and its length."""
    ppl = {c: math.exp(float(np.mean(arr))) for c, arr in losses.items()}
    init_len = train_attention_length(v, args)
    longer = [c for c in sorted(ppl) if c >= init_len]
    best_len = min(longer, key=lambda c: (ppl[c], c))  # the shortest length reaching the best
    diff = losses[init_len] - losses[best_len]  # (P,) paired per-position gain, nats
    se = standard_error(diff)
    longest = max(ppl)
    return {"ppl": ppl, "init_len": init_len, "ppl_init": ppl[init_len], "ppl_best": ppl[best_len],
            "best_len": best_len, "gain_pct": 100 * (1 - ppl[best_len] / ppl[init_len]),
            "longest_len": longest, "ppl_longest": ppl[longest],
            "loss_pct_longest": 100 * (ppl[longest] / ppl[init_len] - 1),
            "gain_nats": float(diff.mean()), "gain_se_nats": se,
            "improves": bool(diff.mean() > SIGNIFICANCE * se),
            "positions": int(next(iter(losses.values())).size)}


def findings(rows: dict[str, dict[str, Any]], losses: dict[str, dict[int, np.ndarray]] | None = None
             ) -> dict[str, Any]:
    """The paper's two qualitative claims, checked on our numbers.

    With the per-position ``losses``, a best run other than ours is compared with ours, each at its best
    length, position by position: ``ours_vs_best`` gives the gap (%) and the paired gap over its standard
    error, so a tie within noise is told from a real loss.
    """
    out: dict[str, Any] = {}
    rows = {n: r for n, r in rows.items() if "-seed" not in n}  # other seeds measure noise, they are no rows
    if rows:
        best = min(rows, key=lambda n: rows[n]["ppl_best"])
        out["best_run"] = best
        out["recurrence_with_ours_is_best"] = best == "relative-rec"
        ours = "relative-rec"
        if losses and best != ours and ours in rows:
            diff = losses[ours][rows[ours]["best_len"]] - losses[best][rows[best]["best_len"]]  # (P,) nats
            se = standard_error(diff)
            out["ours_vs_best"] = {"gap_pct": 100 * (rows[ours]["ppl_best"] / rows[best]["ppl_best"] - 1),
                                   "gap_over_se": float(diff.mean()) / se if se > 0 else math.inf}
        improving = sorted(n for n, r in rows.items() if r["improves"])
        out["improving_with_longer_attention"] = improving
        out["only_ours_keeps_improving"] = bool(improving) and all(n.startswith("relative-") for n in improving)
        # The weaker form: with recurrence, our encoding suffers least from attention longer than in training.
        recurrent = {n: r for n, r in rows.items() if "-rec" in n}
        if recurrent:
            least = min(recurrent, key=lambda n: recurrent[n]["loss_pct_longest"])
            out["recurrent_least_hurt_by_longest_attention"] = least
            out["ours_least_hurt_by_longest_attention"] = least == "relative-rec"
    return out


CLAIMS = (
    # (a, b, what the paper's Table 6 says: a has the lower PPL best)
    ("relative-rec", "shaw-rec", "with recurrence, our encoding beats Shaw et al.'s"),
    ("relative-rec", "relative-norec", "recurrence helps our encoding (Full loss)"),
    ("relative-rec-half", "relative-norec-half", "recurrence helps our encoding (Half loss)"),
    ("relative-rec", "relative-rec-half", "with recurrence, the Full loss beats the Half loss"),
    ("relative-norec", "shaw-norec", "without recurrence, our encoding beats Shaw et al.'s (Full loss)"),
    ("relative-norec-half", "shaw-norec-half", "without recurrence, our encoding beats Shaw et al.'s (Half loss)"),
    ("shaw-norec-half", "absolute-norec-half", "Shaw et al.'s encoding beats Vaswani et al.'s (Half, no recurrence)"),
    ("absolute-norec-half", "al_rfou-norec-half", "Vaswani et al.'s beats Al-Rfou et al.'s (Half, no recurrence)"),
    ("relative-rec", "al_rfou-norec-half", "Transformer-XL beats the vanilla Transformer (Al-Rfou et al., Half)"),
)
"""The pairwise orderings of the paper's first block that the WikiText-2 grid checks."""
NOISE_PAIR = ("relative-rec", "relative-rec-seed1")
"""The same row trained with two seeds: its gap is the run-to-run noise the claims must exceed."""


def paper_best() -> dict[str, float]:
    """The paper's PPL best by our run name (Table 6, first block)."""
    return {Variant(enc, rec, loss).name: best for _, rec, enc, loss, _, best, _ in paper.TABLE6}


def compare(a: str, b: str, rows: dict[str, dict[str, Any]], losses: dict[str, dict[int, np.ndarray]]
            ) -> dict[str, float]:
    """Run ``a`` against ``b``, each at its best attention length: the PPL gap (%, negative when ``a`` is
    better) and the mean per-position loss difference over its paired standard error."""
    diff = losses[a][rows[a]["best_len"]] - losses[b][rows[b]["best_len"]]  # (P,) nats, same positions
    se = standard_error(diff)
    return {"gap_pct": 100 * (rows[a]["ppl_best"] / rows[b]["ppl_best"] - 1),
            "gap_over_se": float(diff.mean()) / se if se > 0 else math.inf}


def claims(rows: dict[str, dict[str, Any]], losses: dict[str, dict[int, np.ndarray]]) -> dict[str, Any]:
    """Each of CLAIMS on our runs: the paper's gap, ours with its paired SE, and a verdict against noise.

    'reproduced': ``a`` is better by more than SIGNIFICANCE paired standard errors and by more than the
    seed-to-seed gap of NOISE_PAIR (when measured); 'reversed': the same, the other way; otherwise
    'within noise'; 'not run yet' while a run is missing.
    """
    noise = compare(*NOISE_PAIR, rows, losses) if all(n in rows for n in NOISE_PAIR) else None
    paper_ppl = paper_best()
    out = []
    for a, b, text in CLAIMS:
        item: dict[str, Any] = {"a": a, "b": b, "claim": text,
                                "paper_gap_pct": 100 * (paper_ppl[a] / paper_ppl[b] - 1)}
        if a in rows and b in rows:
            c = compare(a, b, rows, losses)
            above_noise = noise is None or abs(c["gap_pct"]) > abs(noise["gap_pct"])
            beyond = abs(c["gap_over_se"]) > SIGNIFICANCE and above_noise
            item.update(c, verdict=("reproduced" if c["gap_pct"] < 0 else "reversed") if beyond else "within noise")
        else:
            item["verdict"] = "not run yet"
        out.append(item)
    return {"noise": noise, "claims": out}


def long_memory(runs: dict[str, Any], rows: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, float]]]:
    """The paper's second block: each recurrent run with our encoding at every attention length from its
    training one on, against that training length (PPL change % and the paired gain over its SE)."""
    out = {}
    for name, r in runs.items():
        v = r["variant"]
        if not (v.recurrence and v.attn_type == "relative"):
            continue
        init = rows[name]["init_len"]
        base = r["losses"][init]
        out[name] = []
        for c in sorted(c for c in r["losses"] if c >= init):
            diff = base - r["losses"][c]  # (P,) nats gained by the longer attention
            se = standard_error(diff)
            out[name].append({"attn_len": c, "ratio": c / init, "ppl": math.exp(float(np.mean(r["losses"][c]))),
                              "pct_vs_train_len": 100 * (math.exp(-float(diff.mean())) - 1),
                              "gain_over_se": float(diff.mean()) / se if se > 0 else 0.0})
    return out


def report(runs: dict[str, Any], args: argparse.Namespace, argv: list[str], wall_s: float) -> dict[str, Any]:
    rows = {name: summarise(r["variant"], r["losses"], args) for name, r in runs.items()}
    table_rows = []
    for name, r in runs.items():
        v, s, rec = r["variant"], rows[name], r["record"]
        table_rows.append([name, "yes" if v.recurrence else "no", encoding(v.attn_type).title, v.loss, s["init_len"],
                           s["ppl_init"], s["ppl_best"], s["best_len"], f"{s['gain_pct']:.2f}",
                           f"{s['gain_nats'] / s['gain_se_nats']:.1f}" if s["gain_se_nats"] > 0 else "-",
                           s["ppl_longest"], f"{s['loss_pct_longest']:+.1f}",
                           rec["steps"], f"{rec['train_s']:.0f}", f"{r['eval_wall_s']:.0f}"])
    md = common.markdown_table(["run", "recurrence", "encoding", "loss", "train attn len", "PPL init", "PPL best",
                                "attn len (best)", "gain %", "gain / SE", "PPL at longest", "% vs init", "steps",
                                "train s", "eval s"],
                               table_rows)
    payload = {
        "experiment": "ablation", "command": common.command_line("experiments.ablation", argv),
        "args": {k: v for k, v in vars(args).items()}, "contexts": contexts_of(args), "wall_s": wall_s,
        "corpus": args.corpus,
        "runs": {name: {"attn_type": r["variant"].attn_type, "recurrence": r["variant"].recurrence,
                        "loss": r["variant"].loss, "seed_offset": r["variant"].seed,
                        "train": {k: v for k, v in r["record"].items() if k != "run"},
                        "model": r["record"]["run"]["model"], "eval_wall_s": r["eval_wall_s"],
                        **{k: v for k, v in rows[name].items() if k != "ppl"},
                        "ppl": {str(c): p for c, p in rows[name]["ppl"].items()}}
                 for name, r in runs.items()},
        "findings": findings(rows, {name: r["losses"] for name, r in runs.items()}),
        "grid": [v.name for v in variants_of(args)],
        "long_memory": long_memory(runs, rows),
    }
    if args.corpus != "ptb":  # PTB's grid has no Half rows; its findings above are its whole report
        payload["claims"] = claims(rows, {name: r["losses"] for name, r in runs.items()})
    results, name = Path(args.results), stem("ablation", args.corpus)
    common.write_results(name, payload, md, results)
    plot(runs, rows, results / f"{name}.png", CORPUS_TITLES[args.corpus])
    if payload["long_memory"]:
        plot_long_memory(payload["long_memory"], results / f"{stem('longmem', args.corpus)}.png",
                         CORPUS_TITLES[args.corpus])
    return payload


CORPUS_TITLES = {"ptb": "PTB", "wt2": "WikiText-2"}


def plot(runs: dict[str, Any], rows: dict[str, dict[str, Any]], png: Path, corpus_title: str = "PTB") -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = dict(zip(attn_types(), ("C3", "C0", "C2", "C1", *(f"C{i}" for i in range(4, 10)))))
    for name, r in runs.items():
        v, s = r["variant"], rows[name]
        cs = sorted(s["ppl"])
        style = ("-" if v.recurrence else "--") if v.loss == "Full" else ("-." if v.recurrence else ":")
        ax.plot(cs, [s["ppl"][c] for c in cs], color=colors[v.attn_type], linestyle=style,
                marker="o", markersize=3, alpha=0.6 if v.seed else 1.0,
                label=f"{encoding(v.attn_type).title}, {'recurrence' if v.recurrence else 'no recurrence'}"
                + ("" if v.loss == "Full" else ", Half loss") + (f", seed +{v.seed}" if v.seed else ""))
        ax.plot([s["init_len"]], [s["ppl_init"]], color=colors[v.attn_type], marker="s", markersize=7,
                markerfacecolor="none")
    ax.set_xlabel("evaluation attention length (keys per query)")
    ax.set_ylabel("validation perplexity")
    ax.set_title(f"{corpus_title} ablation (squares: training attention length)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def plot_long_memory(curves: dict[str, list[dict[str, float]]], png: Path, corpus_title: str) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (name, points) in enumerate(curves.items()):
        ax.plot([p["attn_len"] for p in points], [p["ppl"] for p in points], marker="o", markersize=3,
                color=f"C{i}", label=name)
        ax.plot([points[0]["attn_len"]], [points[0]["ppl"]], color=f"C{i}", marker="s", markersize=7,
                markerfacecolor="none")
    common.save_length_plot(plt, fig, ax, png,
                            xlabel="evaluation attention length (keys per query; square: training length)",
                            title=f"{corpus_title}: trained with a short memory, evaluated with longer ones")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    common.setup_logging()
    start = time.perf_counter()
    runs = collect(args)
    payload = report(runs, args, argv, time.perf_counter() - start)
    print(Path(args.results, f"{stem('ablation', args.corpus)}.md").read_text(encoding="utf-8"))
    print(json.dumps(payload["findings"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
