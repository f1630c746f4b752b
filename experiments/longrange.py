"""The paper's argument under control (Dai et al. 2019, section 3.2): key-value recall at known distances.

Every model reads the generated ``recall`` corpus (``txl.data.recall``: ``k=v ... filler ... k v``,
distances log-uniform from 3 to 512 tokens) with the same small budget, and is scored on the answer
tokens alone (the value after the query's key): accuracy (argmax over the whole vocabulary) and loss against the
distance from the definition. The models: the paper's relative encoding with recurrence and without,
Shaw et al.'s and Vaswani et al.'s absolute sinusoids with recurrence, and rotary positions (Su et al.
2021) with recurrence; the main row with a second seed (``-seed1``) for the run-to-run noise.

The argument: with recurrence an N-layer model can carry a dependency about N x mem_len tokens
(each layer reaches mem_len further back through the cached states of the layer below); without, it
stops at the segment. So recurrent models should answer past the segment up to about n_layer x mem_len
and non-recurrent ones fall to chance (1 / n_values) past it; relative encodings should keep their
accuracy when the evaluation memory grows beyond the training one, absolute ones should not.

Scored, on the validation split's answers (the same answers for every model):

* at the training context (memory mem_len, the paper's protocol: segments of tgt_len with memory);
* with longer memories at evaluation (--eval-mems);
* RECL (``txl.recl``, Appendix C) of the group on the answers' losses, each query attending to exactly
  c keys (--recl-contexts, ``same_length``).

Resumable: finished runs (``done.json``) and scores (``scores.json`` per run) are reused, and each worker
(``--worker i/n``) rewrites the results from everything finished so far.

    for i in 0 1; do nohup nice -n 10 python -m experiments.longrange --runs-dir /work/txl-runs/longrange \\
        --threads 1 --worker $i/2 > /work/txl-runs/longrange/worker$i.log 2>&1 & done
    python -m experiments.longrange --runs-dir /work/txl-runs/longrange --report-only
    python -m experiments.longrange --steps 20 --variants relative-rec,relative-norec ...   # a smoke test
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
import torch

from experiments import common, grid
from txl.config import DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from txl.data import Corpus, load_corpus
from txl.data.recall import RecallParams, answers
from txl.evaluate import inference_context
from txl.model import TransformerXL
from txl.recl import recl_details

log = logging.getLogger(__name__)

ENCODING_NAMES = {"relative": "Ours (relative)", "shaw": "Shaw et al. (2018)", "absolute": "Vaswani et al. (2017)",
                  "rotary": "Rotary (Su et al. 2021)"}
RATIOS = (0.1, 0.5, 1.0)
SIGNIFICANCE = 2.0
"""A difference counts when it exceeds this many standard errors."""
BINS = (3, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 600)
"""Edges of the distance bins: [3, 8), [8, 16), ...; the last bin takes the realised distances just past 512."""


@dataclass(frozen=True)
class Variant:
    attn_type: str
    recurrence: bool
    seed: int = 0

    @property
    def name(self) -> str:
        return f"{self.attn_type}-{'rec' if self.recurrence else 'norec'}" + (f"-seed{self.seed}" if self.seed else "")


VARIANTS = (Variant("relative", True), Variant("relative", False), Variant("shaw", True), Variant("absolute", True),
            Variant("relative", True, seed=1), Variant("rotary", True), Variant("relative", False, seed=1),
            Variant("shaw", True, seed=1), Variant("absolute", True, seed=1), Variant("rotary", True, seed=1))
"""In priority order: the four non-rotary models, the main row's second seed, rotary, then second seeds."""

DEFAULTS: dict[str, Any] = {"steps": 3000, "batch_size": 16, "tgt_len": 32, "mem_len": 32, "n_layer": 3,
                            "d_model": 64, "n_head": 4, "d_inner": 256, "dropout": 0.0, "init_std": 0.1, "lr": 1e-3,
                            "seed": 0,
                            "eval_mems": "32,64,128,256,480", "recl_contexts": "32,64,96,128,192,256,384,480",
                            "streams": 8, "valid_tokens": 50_000}
"""The budget: sized for ten runs, one at a time on each of two shared cores, within about 1.5 hours (0.2-0.4 s
a step at load 5-8). lr 1e-3 (warmup 5 %, cosine) and init 0.1 with the corpus's short definitions: the models
form the lookup in about 1,000 steps (at the original init 0.02 none did in 2,500)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("budget (identical for every run)")
    g.add_argument("--steps", type=int)
    g.add_argument("--batch-size", type=int)
    g.add_argument("--tgt-len", type=int, help="training segment length")
    g.add_argument("--mem-len", type=int, help="training memory length of the recurrent runs")
    g.add_argument("--lr", type=float)
    g.add_argument("--seed", type=int)
    m = p.add_argument_group("model")
    m.add_argument("--n-layer", type=int)
    m.add_argument("--d-model", type=int)
    m.add_argument("--n-head", type=int)
    m.add_argument("--d-inner", type=int)
    m.add_argument("--dropout", type=float)
    m.add_argument("--init-std", type=float, help="std of every initial weight (ModelConfig.init_std and "
                   "proj_init_std; the original's 0.02/0.01 leave the models on the recall plateau)")
    e = p.add_argument_group("evaluation")
    e.add_argument("--eval-mems", help="evaluation memory lengths (the training one included)")
    e.add_argument("--recl-contexts", help="RECL's attention lengths, each query seeing exactly c keys")
    e.add_argument("--streams", type=int, help="parallel evaluation streams")
    e.add_argument("--valid-tokens", type=int, help="score the answers among the first N validation tokens")
    p.add_argument("--variants", default="all", help="comma-separated run names (e.g. relative-rec), or all")
    p.add_argument("--out", "--runs-dir", dest="out", default=str(common.RUNS_DIR / "longrange"),
                   help="run directories go here (a folder outside the checkout keeps long runs safe)")
    p.add_argument("--cache-dir", help="token cache (default: <runs-dir>/cache/tokens)")
    p.add_argument("--results", default=str(common.RESULTS_DIR), help="tables and plots go here")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--worker", default="0/1", help="i/n: train runs i, i + n, ... (priority order)")
    p.add_argument("--report-only", action="store_true", help="train nothing: write the results of finished runs")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.longrange", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    for key, value in DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.cache_dir is None:
        args.cache_dir = str(Path(args.out) / "cache" / "tokens")
    return args


def lengths(text: str, flag: str) -> list[int]:
    out = [int(c) for c in text.split(",") if c.strip()]
    if out != sorted(set(out)) or out[0] < 1:
        raise SystemExit(f"--{flag} {text}: give strictly increasing positive lengths")
    return out


def variants_of(args: argparse.Namespace) -> list[Variant]:
    return common.choose_variants(args.variants, VARIANTS)


def run_config(v: Variant, args: argparse.Namespace, vocab_size: int) -> RunConfig:
    """One run: only attn_type, mem_len and the seed differ between runs."""
    longest = max(lengths(args.eval_mems, "eval-mems")[-1], lengths(args.recl_contexts, "recl-contexts")[-1])
    model = ModelConfig(vocab_size=vocab_size, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                        d_inner=args.d_inner, dropout=args.dropout, dropatt=0.0, attn_type=v.attn_type, cutoffs=[],
                        mem_len=args.mem_len if v.recurrence else 0,
                        learned_positions=max(512, longest + args.tgt_len), init_std=args.init_std,
                        proj_init_std=args.init_std)
    return RunConfig(
        data=DataConfig(corpus="recall", cache_dir=str(Path(args.cache_dir).resolve())),
        model=model,
        optim=OptimConfig(lr=args.lr, min_lr=args.lr / 100, schedule="cosine", warmup_steps=max(1, args.steps // 20),
                          clip=0.25),
        train=TrainConfig(out_dir=str(Path(args.out) / v.name), max_steps=args.steps, batch_size=args.batch_size,
                          tgt_len=args.tgt_len, seed=args.seed + v.seed, device="cpu", precision="fp32",
                          eval_interval=0, eval_batches=0, ckpt_interval=max(1, args.steps // 4), keep_last=1,
                          log_interval=max(1, args.steps // 30), tensorboard=False, plot=False, progress=False))


# -- scoring the answers ---------------------------------------------------------------------------

@torch.no_grad()
def answer_scores(model: TransformerXL, tokens: np.ndarray, targets: np.ndarray, *, mem_len: int, seg_len: int,
                  n_streams: int, same_length: bool) -> tuple[np.ndarray, np.ndarray]:
    """Loss (nats) and correctness (argmax over the vocabulary) at ``targets``, positions of ``tokens`` that
    are answers. ``tokens`` is read as ``n_streams`` contiguous streams in ``seg_len``-token segments with
    a memory of ``mem_len`` (``same_length``: every query sees exactly mem_len keys, RECL's protocol). Each
    target must lie in a stream past its first token. Returns two float64 arrays, one entry per target."""
    L = (len(tokens) - 1) // n_streams
    data = torch.as_tensor(np.asarray(tokens[: n_streams * L + 1], dtype=np.int64))
    x, y = data[:-1].view(n_streams, L), data[1:].view(n_streams, L)  # (S, L) each: y[:, t] follows x[:, t]
    nll, hit = [], []
    changes: dict[str, Any] = dict(mem_len=mem_len, same_length=same_length, same_length_style="pytorch", ext_len=0)
    with inference_context(model, **changes) as context:
        cache, memory = model.start_kv_cache(), None
        for s in range(0, L, seg_len):
            out = model(x[:, s:s + seg_len], memory=memory, kv_cache=cache, context=context, return_log_probs=True)
            memory, cache = out.memory, out.kv_cache
            lp = out.log_probs  # (S, T, V)
            target = y[:, s:s + seg_len]  # (S, T)
            nll.append(-lp.gather(-1, target[..., None])[..., 0].double())  # (S, T)
            hit.append((lp.argmax(-1) == target).double())  # (S, T)
    flat_nll, flat_hit = torch.cat(nll, 1).reshape(-1), torch.cat(hit, 1).reshape(-1)  # (S*L,) stream after stream
    # Position p of ``tokens`` is predicted at flat index p - 1 (x[:, t] -> y[:, t]), in stream (p - 1) // L.
    idx = torch.as_tensor(targets - 1)
    return flat_nll[idx].numpy(), flat_hit[idx].numpy()


def scored_targets(tokens: np.ndarray, corpus: Corpus, n_streams: int) -> tuple[np.ndarray, np.ndarray]:
    """The answers (positions, distances) that every stream can score: those whose definition lies in the
    same stream as the answer (a stream starts with an empty memory)."""
    positions, distances = answers(tokens, corpus.tokenizer)
    L = (len(tokens) - 1) // n_streams
    stream = (positions - 1) // L
    keep = (positions - 1 < n_streams * L) & ((positions - distances - 1) // L == stream) & (positions - distances >= 1)
    return positions[keep], distances[keep]


def score_run(run_dir: Path, v: Variant, args: argparse.Namespace, corpus: Corpus, targets: np.ndarray
              ) -> dict[str, Any]:
    """Per-answer losses and hits at every evaluation memory and RECL context, cached in ``scores.npz``."""
    tokens = corpus.valid
    key = {"eval_mems": args.eval_mems, "recl_contexts": args.recl_contexts, "streams": args.streams,
           "tgt_len": args.tgt_len, "n_targets": int(targets.size), "targets_sum": int(targets.sum()),
           "valid_tokens": int(len(tokens))}
    cache, meta = run_dir / "scores.npz", run_dir / "scores.json"
    if cache.is_file() and meta.is_file() and json.loads(meta.read_text(encoding="utf-8")) == key:
        with np.load(cache) as z:
            return {k: z[k] for k in z.files}
    model = common.load_trained(run_dir, which="latest")
    out, start = {}, time.perf_counter()
    for m in lengths(args.eval_mems, "eval-mems"):
        if not v.recurrence and m != lengths(args.eval_mems, "eval-mems")[0]:
            continue  # without recurrence there is no memory to grow
        out[f"nll_m{m}"], out[f"hit_m{m}"] = answer_scores(model, tokens, targets, mem_len=m if v.recurrence else 0,
                                                           seg_len=args.tgt_len, n_streams=args.streams,
                                                           same_length=False)
    for c in lengths(args.recl_contexts, "recl-contexts"):
        out[f"nll_c{c}"], out[f"hit_c{c}"] = answer_scores(model, tokens, targets, mem_len=c, seg_len=args.tgt_len,
                                                           n_streams=args.streams, same_length=True)
    tmp = run_dir / "scores.partial.npz"
    np.savez(tmp, **out)
    tmp.replace(cache)
    meta.write_text(json.dumps(key) + "\n", encoding="utf-8")
    log.info("%s scored in %.0f s", run_dir.name, time.perf_counter() - start)
    return out


def collect(args: argparse.Namespace, *, available_only: bool = False) -> tuple[dict[str, Any], np.ndarray]:
    """Train (or reuse) and score every variant: ({name: {variant, record, scores}}, distances of the targets)."""
    common.set_threads(args.threads)
    corpus = load_corpus("recall", cache_dir=args.cache_dir)
    tokens = corpus.valid[:args.valid_tokens] if args.valid_tokens else corpus.valid
    # txl.train scores the test split once at the end; the experiment reads validation answers only.
    corpus = dataclasses.replace(corpus, valid=tokens, test=corpus.test[:2000])
    targets, distances = scored_targets(tokens, corpus, args.streams)
    runs = {}
    for v in variants_of(args):
        run_dir = Path(args.out) / v.name
        if available_only and not ((run_dir / common.DONE_FILE).is_file() and (run_dir / "scores.npz").is_file()):
            continue
        record = common.train_or_skip(run_config(v, args, corpus.vocab_size), corpus)
        runs[v.name] = {"variant": v, "record": record, "scores": score_run(run_dir, v, args, corpus, targets)}
    return runs, distances


# -- the report ------------------------------------------------------------------------------------

def binned(values: np.ndarray, distances: np.ndarray) -> list[dict[str, float]]:
    """Mean and standard error of ``values`` per distance bin (BINS)."""
    out = []
    for lo, hi in zip(BINS, BINS[1:]):
        sel = values[(distances >= lo) & (distances < hi)]
        n = sel.size
        out.append({"lo": lo, "hi": hi, "n": int(n), "mean": float(sel.mean()) if n else math.nan,
                    "se": float(sel.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan})
    return out


def group_rows(runs: dict[str, Any], distances: np.ndarray, key: str) -> dict[str, dict[str, Any]]:
    """Per model (seeds pooled by name without -seedN): accuracy and loss per bin, each seed's and their mean,
    with the standard error across seeds when there are two or more (else the binomial one of one run)."""
    models: dict[str, list[str]] = {}
    for name in runs:
        models.setdefault(name.split("-seed")[0], []).append(name)
    out = {}
    for model, names in models.items():
        have = [n for n in names if f"hit_{key}" in runs[n]["scores"]]
        if not have:
            continue
        per_seed = {n: {"acc": binned(runs[n]["scores"][f"hit_{key}"], distances),
                        "nll": binned(runs[n]["scores"][f"nll_{key}"], distances)} for n in have}
        rows = {}
        for what in ("acc", "nll"):
            bins = []
            for b in range(len(BINS) - 1):
                means = np.array([per_seed[n][what][b]["mean"] for n in have])
                se = (float(means.std(ddof=1) / math.sqrt(len(means))) if len(means) > 1
                      else per_seed[have[0]][what][b]["se"])
                bins.append({"lo": BINS[b], "hi": BINS[b + 1], "n": per_seed[have[0]][what][b]["n"],
                             "mean": float(means.mean()), "se": se})
            rows[what] = bins
        overall = [float(runs[n]["scores"][f"hit_{key}"].mean()) for n in have]
        out[model] = {"seeds": have, "per_seed": per_seed, **rows, "acc_all": float(np.mean(overall)),
                      "acc_all_seeds": overall}
    return out


def reach(bins: list[dict[str, float]], chance: float, se_mult: float = 2.0) -> int:
    """The upper edge of the last distance bin whose accuracy is above chance by more than ``se_mult`` standard
    errors and above twice chance, with every shorter bin also above (0: none)."""
    edge = 0
    for b in bins:
        if b["n"] and b["mean"] > max(2 * chance, chance + se_mult * (b["se"] if math.isfinite(b["se"]) else 0)):
            edge = b["hi"]
        else:
            break
    return edge


def regions(limits: dict[str, int]) -> list[tuple[int, int]]:
    """Distance ranges the argument separates: within the segment; one hop back through memory (up to
    mem + segment); the rest of n_layer x mem_len; up to n_layer x (mem + segment), the farthest any cached
    state can reach; beyond it."""
    edges = [3, limits["segment"], limits["mem_plus_segment"], limits["n_layer_x_mem_len"],
             limits["n_layer_x_attention"], 10_000]
    edges = sorted(set(edges))
    return list(zip(edges, edges[1:]))


def region_accuracy(runs: dict[str, Any], distances: np.ndarray, key: str, limits: dict[str, int]
                    ) -> dict[str, list[dict[str, float]]]:
    """Per model (seeds pooled): accuracy in each of ``regions`` with its standard error (across seeds where
    there are two or more, at least the binomial one of all their answers; else binomial over the answers)."""
    models: dict[str, list[str]] = {}
    for name in runs:
        if f"hit_{key}" in runs[name]["scores"] or name.endswith("-norec") or "-norec-" in name:
            models.setdefault(name.split("-seed")[0], []).append(name)
    out = {}
    for model, names in models.items():
        keys = [f"hit_{key}" if f"hit_{key}" in runs[n]["scores"] else next(k for k in runs[n]["scores"]
                                                                          if k.startswith("hit_m")) for n in names]
        rows = []
        for lo, hi in regions(limits):
            sel = (distances >= lo) & (distances < hi)
            means = np.array([runs[n]["scores"][k][sel].mean() if sel.any() else math.nan
                              for n, k in zip(names, keys)])
            m = float(means.mean())
            # Two seeds that agree give a tiny spread; the answers' own binomial noise is a floor under it (else
            # a point above chance would count as "above chance" by many standard errors).
            binomial = math.sqrt(m * (1 - m) / max(1, int(sel.sum()) * len(means)))
            se = max(float(means.std(ddof=1) / math.sqrt(len(means))), binomial) if len(means) > 1 else binomial
            rows.append({"lo": lo, "hi": hi, "n": int(sel.sum()), "acc": m, "se": se})
        out[model] = rows
    return out


def findings(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The paper's claims (section 3.2, 3.3) on this corpus, each with the numbers it rests on and a verdict:
    a difference counts when it exceeds SIGNIFICANCE standard errors."""
    chance, lim, reg = payload["chance_accuracy"], payload["limits"], payload["regions"]
    out = []

    def acc(model: str, lo: int) -> dict[str, float] | None:
        return next((r for r in reg.get(model, []) if r["lo"] == lo), None)

    def above(r: dict[str, float] | None) -> bool:
        return r is not None and r["n"] > 0 and r["acc"] - chance > SIGNIFICANCE * max(r["se"], 1e-9)

    def near(r: dict[str, float] | None) -> bool:  # within noise of chance, or within 2 points of it
        return r is not None and r["n"] > 0 and abs(r["acc"] - chance) <= SIGNIFICANCE * max(r["se"], 1e-9) + 0.02

    seg, hop = lim["segment"], lim["mem_plus_segment"]
    # A claim about distance can only be tested on a model that learned the task where nothing limits it: the
    # answers within one segment, which every model can see.
    learned = sorted(m for m in reg if above(acc(m, reg[m][0]["lo"])))
    out.append({"claim": "the models learned recall where every model can see the definition (within the segment)",
                "verdict": "yes: " + ", ".join(learned) if learned else "no model did: the claims below are not "
                "testable on this training budget", "learned": learned})
    for model in ("relative-rec", "shaw-rec", "absolute-rec", "rotary-rec"):
        if model in reg:
            r1, r2 = acc(model, seg), acc(model, hop)
            verdict = ("reproduced" if above(r1) and above(r2) else "partly: beyond the segment, not past one hop"
                       if above(r1) else "not reproduced" if learned else "not testable (nothing learned)")
            out.append({"claim": f"{model}: recurrence carries answers past the segment ({seg}) towards "
                        f"n_layer x mem_len ({lim['n_layer_x_mem_len']})", "verdict": verdict,
                        "regions": [r1, r2]})
    if "relative-norec" in reg:
        beyond = [r for r in reg["relative-norec"] if r["lo"] >= seg and r["n"]]
        verdict = ("reproduced" if beyond and all(near(r) for r in beyond) else "not reproduced") if learned else \
            "not testable (nothing learned: at chance everywhere)"
        out.append({"claim": f"relative-norec: at chance past the segment ({seg})", "verdict": verdict,
                    "regions": beyond})
    lm = payload["longer_memory"]
    mems = sorted(int(m[1:]) for m in lm)
    train, longest = f"m{payload['args']['mem_len']}", f"m{mems[-1]}"
    for model, expect in (("relative-rec", "keeps"), ("rotary-rec", "keeps"), ("shaw-rec", "keeps"),
                          ("absolute-rec", "loses")):
        if model in lm.get(train, {}) and model in lm.get(longest, {}):
            a, b = lm[train][model]["acc_all"], lm[longest][model]["acc_all"]
            n = payload["answers"]
            se = math.sqrt(max(a * (1 - a), b * (1 - b), 1e-6) * 2 / n)
            kept = b >= a - SIGNIFICANCE * se
            verdict = ("reproduced" if kept == (expect == "keeps") else "not reproduced") if model in learned \
                else "not testable (not learned)"
            out.append({"claim": f"{model} {expect} its accuracy with memory {mems[-1]} at evaluation "
                        f"(trained with {payload['args']['mem_len']})", "verdict": verdict,
                        "acc_train_mem": a, "acc_longest_mem": b, "se": se})
    if payload["recl"]:
        recl1 = {n: v["recl"] for n, v in payload["recl"]["1.0"].items()}
        top = max(recl1.values())
        leaders = sorted(n for n, v in recl1.items() if v == top)
        verdict = ("reproduced" if leaders == ["relative-rec"] else "tied" if "relative-rec" in leaders
                   else "not reproduced")
        out.append({"claim": "relative-rec has the longest RECL of the group (r = 1)",
                    "verdict": verdict if learned else verdict + " (but nothing was learned: RECL then measures noise)",
                    "longest": leaders, "recl": recl1})
    return out


def recl_of(runs: dict[str, Any], contexts: list[int]) -> dict[str, Any]:
    """RECL of the group (seed 0 of each model) on the answers' losses, each query attending to exactly c keys."""
    group = {n: {c: r["scores"][f"nll_c{c}"] for c in contexts} for n, r in runs.items()
             if "-seed" not in n and f"nll_c{contexts[0]}" in r["scores"]}
    if len(group) < 2:
        return {}
    out = {}
    for r in RATIOS:
        details = recl_details(group, contexts, r=r, threshold=0.01)
        out[str(r)] = {n: {"recl": d.recl, "saturated": d.saturated, "gains": [list(g) for g in d.gains]}
                       for n, d in details.items()}
    return out


def report(runs: dict[str, Any], distances: np.ndarray, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    params = RecallParams()
    chance = 1.0 / params.n_values
    mems, contexts = lengths(args.eval_mems, "eval-mems"), lengths(args.recl_contexts, "recl-contexts")
    train_key = f"m{args.mem_len}"
    main = group_rows(runs, distances, train_key)
    longer = {f"m{m}": group_rows(runs, distances, f"m{m}") for m in mems}
    limits = {"segment": args.tgt_len, "mem_plus_segment": args.mem_len + args.tgt_len,
              "n_layer_x_mem_len": args.n_layer * args.mem_len,
              "n_layer_x_attention": args.n_layer * (args.mem_len + args.tgt_len)}
    norec = {n: group_rows({k: r for k, r in runs.items() if k.split("-seed")[0] == n}, distances, "m" + str(mems[0]))
             for n in main if n.endswith("-norec")}
    for n, rows in norec.items():  # a model without memory is scored without one (mem_len 0 in its config)
        main[n] = rows[n]
    payload = {
        "experiment": "longrange", "command": common.command_line("experiments.longrange", argv),
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "report_only")},
        "corpus": {"name": "recall", **{k: v for k, v in params.__dict__.items()}},
        "chance_accuracy": chance, "chance_nll": math.log(params.n_values), "limits": limits,
        "answers": int(distances.size), "bins": list(BINS),
        "runs": {n: {"attn_type": r["variant"].attn_type, "recurrence": r["variant"].recurrence,
                     "seed_offset": r["variant"].seed, "train": {k: v for k, v in r["record"].items() if k != "run"},
                     "model": r["record"]["run"]["model"]} for n, r in runs.items()},
        "by_distance": main,
        "reach": {n: reach(rows["acc"], chance) for n, rows in main.items()},
        "longer_memory": {m: {n: {"acc_all": rows["acc_all"], "acc": [b["mean"] for b in rows["acc"]],
                                  "acc_se": [b["se"] for b in rows["acc"]]}
                              for n, rows in g.items() if not n.endswith("-norec")} for m, g in longer.items()},
        "recl": recl_of(runs, contexts), "recl_contexts": contexts,
        "regions": region_accuracy(runs, distances, train_key, limits),
    }
    payload["findings"] = findings(payload)
    headers = ["model", "seeds", *[f"{b['lo']}-{b['hi'] - 1}" for b in next(iter(main.values()))["acc"]], "all",
               "reach"]
    rows = [[n, len(r["seeds"]), *[f"{100 * b['mean']:.0f} ± {100 * b['se']:.0f}" if b["n"] else "-" for b in r["acc"]],
             f"{100 * r['acc_all']:.1f}", payload["reach"][n]] for n, r in main.items()]
    md = ["Answer accuracy (%) by distance from the definition (tokens), mean ± standard error "
          f"(across seeds where there are two, else binomial); chance {100 * chance:.2f}%; segment {args.tgt_len}, "
          f"n_layer x mem_len {limits['n_layer_x_mem_len']}.", "",
          common.markdown_table(headers, rows)]
    md += ["Answer loss (nats) by distance; chance ln(n_values) = " f"{math.log(params.n_values):.2f}.", "",
           common.markdown_table(["model", *headers[2:-2]],
                                 [[n, *[f"{b['mean']:.2f}" if b["n"] else "-" for b in r["nll"]]]
                                  for n, r in main.items()])]
    lm_rows = [[n, *[f"{100 * payload['longer_memory'][f'm{m}'][n]['acc_all']:.1f}"
                     if n in payload["longer_memory"][f"m{m}"] else "-" for m in mems]]
               for n in main if not n.endswith("-norec")]
    md += ["Accuracy (%) over all answers with a longer memory at evaluation (trained with "
           f"{args.mem_len}):", "", common.markdown_table(["model", *[f"mem {m}" for m in mems]], lm_rows)]
    longest_lm = payload["longer_memory"][f"m{mems[-1]}"]
    md += [f"Accuracy (%) by distance with the longest memory at evaluation ({mems[-1]}):", "",
           common.markdown_table(["model", *headers[2:-2]],
                                 [[n, *[f"{100 * a:.0f}" if b["n"] else "-" for a, b in zip(longest_lm[n]["acc"],
                                                                                             main[n]["acc"])]]
                                  for n in main if n in longest_lm])]
    if payload["recl"]:
        md += ["RECL of the group on the answers' losses (exactly c keys per query; `>=`: the largest c, a "
               "lower bound):", "",
               common.markdown_table(["model", *[f"RECL r={r:g}" for r in RATIOS]],
                                     [[n, *[(">=" if payload["recl"][str(r)][n]["saturated"] else "")
                                            + str(payload["recl"][str(r)][n]["recl"]) for r in RATIOS]]
                                      for n in payload["recl"]["1.0"]])]
    results = Path(args.results)
    common.write_results("longrange", payload, "\n".join(md), results)
    plot(main, payload, results / "longrange.png", args)
    return payload


def plot(main: dict[str, Any], payload: dict[str, Any], png: Path, args: argparse.Namespace) -> None:
    """Accuracy and loss against distance at the training memory, and accuracy with the longest evaluation
    memory; the segment, mem_len + segment and n_layer x mem_len marked."""
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    colors = {"relative": "C3", "shaw": "C0", "absolute": "C2", "rotary": "C4"}
    longest = max(payload["longer_memory"], key=lambda m: int(m[1:]))
    for name, r in main.items():
        centers = [math.sqrt(b["lo"] * (b["hi"] - 1)) for b in r["acc"]]
        enc = name.split("-")[0]
        style = "-" if name.endswith("-rec") else "--"
        label = (f"{ENCODING_NAMES.get(enc, enc)}, {'recurrence' if name.endswith('-rec') else 'none'}"
                 f" ({len(r['seeds'])} seed{'s' if len(r['seeds']) > 1 else ''})")
        for ax, what, scale in ((axes[0], "acc", 100), (axes[1], "nll", 1)):
            ax.errorbar(centers, [scale * b["mean"] for b in r[what]], yerr=[scale * b["se"] for b in r[what]],
                        color=colors.get(enc, "k"), linestyle=style, marker="o", markersize=3, capsize=2, label=label)
        if name in payload["longer_memory"][longest]:
            lm = payload["longer_memory"][longest][name]
            axes[2].errorbar(centers, [100 * a for a in lm["acc"]], yerr=[100 * e for e in lm["acc_se"]],
                             color=colors.get(enc, "k"), linestyle=style, marker="o", markersize=3, capsize=2,
                             label=label)
    lim = payload["limits"]
    marks = ((lim["segment"], "--", " segment"), (lim["mem_plus_segment"], ":", " mem + segment"),
             (lim["n_layer_x_mem_len"], "-.", " n_layer x mem_len"))
    for ax, chance in ((axes[0], 100 * payload["chance_accuracy"]), (axes[1], payload["chance_nll"]),
                       (axes[2], 100 * payload["chance_accuracy"])):
        ax.axhline(chance, color="k", linewidth=0.8, linestyle=":", label="chance")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("distance from the definition (tokens)")
        ax.grid(alpha=0.3, which="both")
        top = ax.get_ylim()[1]
        for x, style, text in marks:
            ax.axvline(x, color="0.4", linewidth=1, linestyle=style)
            ax.text(x, top, text, fontsize=7, va="top", rotation=90)
    axes[0].set_ylabel("answer accuracy, %")
    axes[1].set_ylabel("answer loss, nats")
    axes[2].set_ylabel("answer accuracy, %")
    axes[0].set_title(f"evaluation memory {args.mem_len} (as in training)", fontsize=9)
    axes[1].set_title(f"evaluation memory {args.mem_len}", fontsize=9)
    axes[2].set_title(f"evaluation memory {longest[1:]} (trained with {args.mem_len})", fontsize=9)
    axes[0].legend(fontsize=7, loc="center left")
    fig.suptitle(f"Key-value recall: {args.n_layer} layers, segment {args.tgt_len}, memory {args.mem_len}")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def drive(argv: list[str], args, variants_of, collect, report, results_md: str) -> int:
    """The grid driver of a recall experiment (this one and experiments.compressive): train and score this worker's
    share of the variants (a report after each), then report every finished run and print the table."""
    i, n = grid.parse_worker(args.worker)
    common.setup_logging()
    if not args.report_only:
        for v in variants_of(args)[i::n]:
            one = copy.copy(args)
            one.variants = v.name
            with grid.claim(Path(args.out) / v.name) as mine:
                if not mine:
                    log.info("%s: another worker is on it, skipped", v.name)
                    continue
                collect(one)
            runs, distances = collect(args, available_only=True)
            report(runs, distances, args, grid.command(argv))
    runs, distances = collect(args, available_only=True)
    if not runs:
        print("no run is finished and scored yet")
        return 0
    report(runs, distances, args, grid.command(argv))
    print(Path(args.results, results_md).read_text(encoding="utf-8"))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return drive(argv, parse_args(argv), variants_of, collect, report, "longrange.md")

if __name__ == "__main__":
    raise SystemExit(main())
