"""Write docs/results.md from the experiments' JSON results (no number in it is typed by hand;
the paper's numbers come from ``experiments.paper``).

    python -m experiments.report
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from experiments import ROOT, ablation, char, common, paper
from txl.model.attention import attn_types, encoding

ENC = {t: encoding(t).title for t in attn_types()}


def _load(results: Path, stem: str) -> dict[str, Any] | None:
    file = results / f"{stem}.json"
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else None


def _defaults(add_arguments, resolve) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return vars(resolve(p.parse_args([])))


def _reduced(args: dict[str, Any], defaults: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    """The budget-relevant flags that differ from the full (default) run."""
    return [f"--{k.replace('_', '-')} {args[k]} (full: {defaults[k]})" for k in keys if args.get(k) != defaults[k]]


def _mins(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def ablation_section(a: dict[str, Any], img: str,
                     title: str = "## 1. Ablation: recurrence x positional encoding (the paper's Table 6), PTB words",
                     ) -> list[str]:
    runs, f = a["runs"], a["findings"]
    corpus = a["args"].get("corpus", "ptb")
    defaults = ablation.defaults(corpus)
    full = "python -m experiments.ablation" + ("" if corpus == "ptb" else f" --corpus {corpus}")
    reduced = _reduced(a["args"], defaults, ("steps", "minutes_per_run", "batch_size", "tgt_len", "mem_len",
                                                  "valid_tokens", "contexts"))
    any_run = next(iter(runs.values()))
    m, args = any_run["model"], a["args"]
    tokens = args["steps"] * args["batch_size"] * args["tgt_len"]
    out = [title, ""]
    if reduced:
        per_step = sum(r["train"]["train_s"] / max(1, r["train"]["steps"]) for r in runs.values())
        out += [f"**Reduced budget.** This run used {', '.join(reduced)}. The full budget is "
                f"`{full}` with its defaults (then `{full.replace('ablation', 'recl')}` and "
                "`python -m experiments.report`); at this run's time per step its training would take about "
                f"{per_step * defaults['steps'] / 3600:.1f} h on this shared machine.", ""]
    out += [f"Command: `{a['command']}` (this invocation took {_mins(a['wall_s'])}: it reuses finished runs "
            "and cached losses; each run's own training and evaluation times are in the table, in seconds).", "",
            f"Every run: {m['n_layer']} layers, d_model {m['d_model']}, {m['n_head']} heads, d_inner {m['d_inner']}, "
            f"dropout {m['dropout']}, adaptive softmax cutoffs {m['cutoffs']}; {args['steps']} steps of "
            f"{args['batch_size']} x {args['tgt_len']} tokens ({tokens:,} training tokens), Adam lr {args['lr']} "
            f"with cosine decay; memory {args['mem_len']} with recurrence, 0 without. Only `attn_type` and "
            "`mem_len` differ between runs" + ("." if corpus == "ptb" else ", and the loss (`train.loss_positions`: "
                                                "Full = every position of a training segment, Half = its last half) "
                                                "and, for the noise run, the seed (`-seed1`: --seed + 1)."),
            "",
            f"Evaluation: {'the first ' + format(args['valid_tokens'], ',') if args['valid_tokens'] else 'all the'} "
            f"validation tokens in {args['streams']} streams, "
            f"the same {any_run['positions']:,} positions for every model and attention length (the first "
            "positions of each stream, which have less history, are dropped). As the paper evaluates and as the "
            f"models were trained: segments of {args['tgt_len']} tokens with a memory of A - {args['tgt_len']}, so "
            "the last query of a segment attends to A keys (the absolute encodings number positions within the "
            "keys, so only the training segment length shows them the positions they were trained on). PPL init "
            "is at the training attention length (memory + segment with recurrence, the segment alone without); "
            "PPL best is the best over A >= that length, with the shortest A reaching it; 'PPL at longest' and "
            "'% vs init' are at the longest A evaluated.", ""]
    out.append(Path(a["_md"]).read_text(encoding="utf-8"))
    out += [f"![perplexity against evaluation attention length]({img})", "",
            "Perplexity at every evaluated attention length:", ""]
    grid = a["contexts"]
    out.append(common.markdown_table(["run", *[str(c) for c in grid]],
                                     [[n, *[r["ppl"][str(c)] for c in grid]] for n, r in runs.items()]))
    out += ["The paper (WikiText-103, Table 6, first block; transcribed in `experiments/paper.py`):", ""]
    out.append(common.markdown_table(
        ["remark", "recurrence", "encoding", "loss", "PPL init", "PPL best", "attn len"],
        [[r[0], "yes" if r[1] else "no", ENC[r[2]], r[3], r[4], r[5], r[6]] for r in paper.TABLE6]))
    improving = f["improving_with_longer_attention"]
    out += ["Findings, checked on our numbers:", "",
            f"* *Recurrence with our encoding is best*: "
            f"{'reproduced' if f['recurrence_with_ours_is_best'] else 'not reproduced'}; the best run is "
            f"`{f['best_run']}` (PPL best {runs[f['best_run']]['ppl_best']:.2f})" + (
                f"; `relative-rec` is {f['ours_vs_best']['gap_pct']:.2f}% above it, a paired per-position "
                f"difference of {f['ours_vs_best']['gap_over_se']:.1f} standard errors"
                if "ours_vs_best" in f else "") + ".",
            f"* *Only our encoding keeps improving as the evaluation attention grows*: "
            f"{'reproduced' if f['only_ours_keeps_improving'] else 'not reproduced'}; runs whose loss at the best "
            f"length is below the one at the training length by more than {ablation.SIGNIFICANCE:g} standard "
            "errors of the paired per-position difference (column gain / SE): "
            f"{', '.join(f'`{n}`' for n in improving) if improving else 'none'}."]
    if "recurrent_least_hurt_by_longest_attention" in f:
        least = f["recurrent_least_hurt_by_longest_attention"]
        out += [f"* *Weaker form: with recurrence, our encoding suffers least from the longest attention*: "
                f"{'reproduced' if f['ours_least_hurt_by_longest_attention'] else 'not reproduced'}; of the "
                f"recurrent runs, `{least}` changes least from its PPL init to the longest length "
                f"({runs[least]['loss_pct_longest']:+.1f}%)."]
    out.append("")
    return out


def recl_section(r: dict[str, Any], img: str,
                 title: str = "## 2. Relative effective context length (Appendix C)") -> list[str]:
    out = [title, "",
           f"Command: `{r['command']}` (wall time {_mins(r['wall_s'])}; it reuses the ablation's models and "
           "cached losses, training them first if they are missing).", "",
           f"Group: {len(r['group'])} ablation models ({', '.join(f'`{n}`' for n in r['group'])}); "
           f"contexts {r['contexts']}; threshold {r['threshold']}; "
           f"{r['positions']:,} validation positions, the same for every model and context. Each query attends "
           "to exactly c keys (`context=model.config.context(mem_len=c, same_length=True)`) so that l_i(c, t) compares "
           "models on identical positions and context sizes; the recurrent memory can still carry older "
           "information through the layers, which is what RECL credits. `>=` marks a RECL that reached the "
           "largest evaluated context (a lower bound). Beside RECL, read each model's perplexity at the shortest "
           "and longest context under this protocol and how far its per-position losses move between "
           "neighbouring contexts (mean absolute change, nats): the gain g_i counts the positions where the "
           "model's loss at the longer context falls below the group's best at the shorter one and never "
           "those where it rises, so a model whose losses move a lot at random earns gain without using the "
           "context.", ""]
    out.append(Path(r["_md"]).read_text(encoding="utf-8"))
    out += [f"![relative gains along the RECL search]({img})", "",
            "The paper (WikiText-103, Table 8, the ablation group):", ""]
    out.append(common.markdown_table(["model", "r=0.1", "r=0.5", "r=1"], [list(x) for x in paper.TABLE8_GROUP2]))
    recl1 = {n: v["recl"] for n, v in r["recl"]["1.0"].items()}
    top = max(recl1.values())
    leaders = sorted(n for n, v in recl1.items() if v == top)
    ours = "relative-rec"
    if ours in recl1:
        verdict = ("reproduced" if leaders == [ours] else
                   "partly reproduced (tied)" if ours in leaders else "not reproduced")
        out += [f"*Transformer-XL (recurrence + our encoding) has the longest RECL* (r = 1): {verdict}; "
                f"longest: {', '.join(f'`{n}`' for n in leaders)} ({top}).", ""]
    return out


def speedup_section(s: dict[str, Any] | None) -> list[str]:
    out = ["## 3. Evaluation speed-up over a vanilla Transformer", ""]
    if s is None:
        return out + ["Not measured yet: run `python -m experiments.speedup`. The paper's numbers (Table 9, GPU):",
                      "", common.markdown_table(["attention length", "speed-up"],
                                                [[k, f"{v}x"] for k, v in paper.TABLE9_SPEEDUP.items()])]
    return out + [f"Command: `{s['command']}` (wall time {_mins(s['wall_s'])}), benchmark shape `{s['shape']}`, "
                  "batch 1, fp32: Transformer-XL reads segments of L tokens with L cached states (keys and values "
                  "carried); the vanilla model (Al-Rfou et al.'s learned absolute positions, no memory) re-reads an "
                  "L-token window for every predicted token (`benchmarks.run`, `worker_speedup`). 'FLOP ratio' "
                  "is the ratio of the two models' executed forward FLOPs per predicted token; the paper's column "
                  "is its Table 9 (GPU; it also lists 773x at 1,800, 1,409x at 2,800 and 1,874x at 3,800).", "",
                  Path(s["_md"]).read_text(encoding="utf-8")]


def char_section(c: dict[str, Any], img: str) -> list[str]:
    defaults = _defaults(char.add_arguments, char.resolve)
    reduced = _reduced(c["args"], defaults, ("steps", "minutes", "batch_size", "tgt_len", "mem_len", "valid_tokens",
                                                  "contexts"))
    m, t = c["model"], c["train"]
    out = ["## 4. Character level: bits per character against attention length", ""]
    if reduced:
        out += [f"**Reduced budget.** This run used {', '.join(reduced)}; the full one is "
                "`python -m experiments.char`.", ""]
    out += [f"Command: `{c['command']}` (wall time {_mins(c['wall_s'])}; training {_mins(t['train_s'])}, "
            f"{t['steps']} steps; evaluation {_mins(c['eval_wall_s'])}).", "",
            f"Corpus `{c['corpus']}`; {m['n_layer']} layers, d_model {m['d_model']}, relative encoding, memory "
            f"{m['mem_len']}, segment {c['args']['tgt_len']} (training attention length {c['train_attn_len']}); "
            f"{c['positions']:,} validation positions scored at every length.", ""]
    out.append(Path(c["_md"]).read_text(encoding="utf-8"))
    out += [f"![bits per character against attention length]({img})", "",
            (f"Best {c['bpc_best']:.3f} bpc at attention length {c['best_len']}, against "
             f"{c['bpc_train_len']:.3f} at the training length {c['train_attn_len']}." if c["best_len"] !=
             c["train_attn_len"] else f"Best {c['bpc_best']:.3f} bpc at the training attention length "
             f"{c['best_len']}: no other attention length does better."), ""]
    return out


def wall_times(a: dict[str, Any] | None, title: str = "## Wall time of each ablation run") -> list[str]:
    if a is None:
        return []
    rows = [[n, _mins(r["train"]["train_s"]) + (" (resumed, from its log)" if r["train"]["resumed"] else ""),
             r["train"]["steps"], r["train"]["stopped"], _mins(r["eval_wall_s"])] for n, r in a["runs"].items()]
    total = sum(r["train"]["train_s"] for r in a["runs"].values())
    return [title, "",
            "Measured on the 2-core CPU described in the introduction, two runs at a time, each with `--threads 1` "
            "(`--variants` splits the grid between two processes; the listed command then reused the finished "
            "runs), so one run's time is what one core gives it. Runs interrupted by a restart of the machine "
            "resumed from their last checkpoint; their training time is estimated from the training log (the steps of "
            "each logged interval at its measured rate), as if uninterrupted. "
            "'eval' is the time spent computing that run's per-position losses at every attention length.", "",
            common.markdown_table(["run", "train", "steps", "stopped by", "eval"], rows),
            f"Training total: {_mins(total)}.", ""]


WT2_FLAGS = ("--corpus wt2 --data-dir ../shared/data/wikitext-2 --runs-dir /work/txl-runs/wt2/runs "
             "--results docs/results --valid-tokens 60000")
"""The flags of the WikiText-2 grid as it runs (the first 60,000 validation tokens keep evaluation at about
a tenth of a run's time on a busy core; drop --valid-tokens to score all of them, reusing the models)."""
WT2_RESUME = (f"for i in 0 1; do nohup nice -n 10 python -m experiments.grid {WT2_FLAGS} --threads 1 "
              "--worker $i/2 > /work/txl-runs/wt2/worker$i.log 2>&1 & done")
"""How the WikiText-2 grid is started and resumed (two workers, one core each, in the background)."""


def sizing_lines(z: dict[str, Any] | None) -> list[str]:
    if z is None:
        return []
    load = z["load_average_1min"]
    return [f"Model size. Seconds per training step of candidate sizes, the grid's costliest row (ours with "
            f"recurrence), {z['batch_size']} x {z['tgt_len']} tokens, memory {z['mem_len']}, one thread "
            f"(`{z['command']}`; measured while the machine was shared, 1-minute load average {load[0]:.1f} "
            f"before and {load[1]:.1f} after, so the times are those of a busy core):", "",
            Path(z["_md"]).read_text(encoding="utf-8")]


def wt2_section(a: dict[str, Any] | None, r: dict[str, Any] | None, z: dict[str, Any] | None, rel: str,
                clamp: dict[str, Any] | None = None) -> list[str]:
    """Section 5: the WikiText-2 grid (Table 6 with both losses), longer memory, RECL, plan and status."""
    d = ablation.defaults("wt2")
    n_runs = len(ablation.WT2_VARIANTS)
    out = ["## 5. WikiText-2 (long articles): Table 6 with Full and Half losses, longer memory, RECL", "",
           "Penn Treebank's sentences are short, so section 1 could not show context beyond a segment paying off. "
           "WikiText-2 has the long Wikipedia articles of the paper's WikiText-103 (2.09M training tokens, "
           "vocabulary 33,278). The grid: the nine rows of the paper's first block (recurrence on: ours Full, "
           "Shaw Full, ours Half; off: ours Full and Half, Shaw Full and Half, Vaswani Half, Al-Rfou Half), the "
           "Full Vaswani and Al-Rfou rows for context, and the main row again with another seed to measure the "
           f"run-to-run noise: {n_runs} runs, in the order that answers the main question first "
           f"({', '.join(f'`{v.name}`' for v in ablation.WT2_VARIANTS)}).", "",
           f"Plan. Every run: {d['n_layer']} layers, d_model {d['d_model']}, {d['n_head']} heads, d_inner "
           f"{d['d_inner']}, adaptive softmax cutoffs {d['cutoffs']}; {d['steps']} steps of {d['batch_size']} x "
           f"{d['tgt_len']} tokens (about {d['steps'] * d['batch_size'] * d['tgt_len'] / 2.088628e6:.1f} epochs), "
           f"memory {d['mem_len']} with recurrence; evaluation at attention lengths {d['contexts']} (up to "
           f"{int(d['contexts'].split(',')[-1]) // (d['tgt_len'] + d['mem_len'])}x the recurrent models' training "
           "attention length, the paper's second block).", ""]
    out += sizing_lines(z)
    chosen = [x for x in (z or {}).get("rows", []) if x["flags"][1::2] == [str(d["n_layer"]), str(d["d_model"]),
                                                                          str(d["n_head"]), str(d["d_inner"])]]
    if chosen:
        c = chosen[0]
        hours = c["s_per_step"] * d["steps"] * n_runs / 3600
        out += [f"The grid uses candidate `{c['candidate']}`, the smallest: at its measured {c['s_per_step']:.2f} s "
                f"per step the {n_runs} runs' training takes about {hours:.0f} core-hours (about "
                f"{hours / 2:.0f} h on two cores, plus evaluation), the larger candidates two to three times that. "
                "It was chosen so that the runs of the main question and of the noise could finish within the "
                "working session that started them on this shared machine. Whether differences of the size "
                "the paper reports (3-10% in perplexity) stand above the run-to-run noise at this scale is what "
                "the second seed of the main row measures (below); where they do not, a larger model and more "
                "steps are the next step, and the same commands run them (`--n-layer`, `--d-model`, `--steps`, "
                "into another --runs-dir).", ""]
    out += ["Commands (from the repository root; every one resumes where it stopped, runs and losses are reused):",
            "", "```", "# start or resume the grid: two background workers, one core each", WT2_RESUME,
            "# the results of the runs finished so far, then this document",
            f"python -m experiments.grid {WT2_FLAGS} --report-only",
            "python -m experiments.report", "```", ""]
    if a is None:
        return out + ["No WikiText-2 run has finished yet.", ""]
    done = list(a["runs"])
    missing = [n for n in a.get("grid", []) if n not in done]
    if missing:
        out += [f"**Incomplete.** {len(done)} of {len(a.get('grid', done))} runs are finished and scored "
                f"({', '.join(f'`{n}`' for n in done)}); not yet: {', '.join(f'`{n}`' for n in missing)}. Every "
                "verdict below is about the finished runs only.", ""]
    out += ablation_section(a, f"{rel}/ablation_wt2.png", title="### Table 6 on WikiText-2")
    c = a.get("claims")
    if c:
        noise = c["noise"]
        out += ["The paper's orderings, run against run, each at its best attention length. 'gap' is the PPL "
                "difference in % (negative: the first run is better, as the paper has it); 'gap / SE' the mean "
                "per-position loss difference over its paired standard error (the same validation positions). "
                + (f"The noise: `{ablation.NOISE_PAIR[1]}`, the main row with another seed, is "
                   f"{noise['gap_pct']:+.2f}% from `{ablation.NOISE_PAIR[0]}` ({noise['gap_over_se']:+.1f} SE), so "
                   "positions alone understate the run-to-run noise whenever that gap is many SE. "
                   if noise else "The seed-to-seed noise is not measured yet (its run is not finished), so the "
                   "verdicts rest on the paired SE alone, which leaves out run-to-run noise. ")
                + f"A claim is 'reproduced' when the gap has the paper's sign, exceeds {ablation.SIGNIFICANCE:g} "
                "SE and exceeds the seed-to-seed gap; 'reversed' when the same holds the other way; otherwise "
                "'within noise'.", ""]
        out.append(common.markdown_table(
            ["claim (paper, Table 6)", "runs", "paper gap %", "our gap %", "gap / SE", "verdict"],
            [[x["claim"], f"`{x['a']}` vs `{x['b']}`", f"{x['paper_gap_pct']:+.1f}",
              f"{x['gap_pct']:+.2f}" if "gap_pct" in x else "-",
              f"{x['gap_over_se']:+.1f}" if "gap_over_se" in x else "-", x["verdict"]] for x in c["claims"]]))
    lm = a.get("long_memory") or {}
    name_long, init_long, best_long, len_long = paper.TABLE6_LONG_MEMORY
    name_long = name_long.removeprefix("Transformer-XL ").strip("()")
    if lm:
        out += ["### Trained with a short memory, evaluated with longer ones (the paper's second block)", "",
                "Our recurrent models evaluated with the memory grown past the training one (segments of the "
                "training length, memory A - segment). '% vs training length' is the perplexity change from the "
                "training attention length; 'gain / SE' the paired per-position gain over its standard error. "
                f"The paper's {name_long} WikiText-103 model goes from {init_long} at its training length to "
                f"{best_long} at {len_long} ({100 * (best_long / init_long - 1):+.1f}%).", ""]
        for name, points in lm.items():
            out += [f"`{name}`:", "", common.markdown_table(
                ["attention length", "x training", "PPL", "% vs training length", "gain / SE"],
                [[p["attn_len"], f"{p['ratio']:g}", p["ppl"], f"{p['pct_vs_train_len']:+.2f}",
                  f"{p['gain_over_se']:.1f}"] for p in points])]
        out += [f"![perplexity against a longer evaluation memory]({rel}/longmem_wt2.png)", ""]
        if "relative-rec" in lm:
            points = lm["relative-rec"]
            best = min(points, key=lambda p: (p["ppl"], p["attn_len"]))
            gains = best["attn_len"] > points[0]["attn_len"] and best["gain_over_se"] > ablation.SIGNIFICANCE
            out += [f"*A model trained with a short memory gains from a longer one at evaluation*: "
                    f"{'reproduced' if gains else 'not reproduced'}; `relative-rec` is best at attention length "
                    f"{best['attn_len']} ({best['ratio']:g}x its training length), {best['pct_vs_train_len']:+.2f}% "
                    f"from its training length ({best['gain_over_se']:.1f} SE), and "
                    f"{points[-1]['pct_vs_train_len']:+.2f}% at the longest, {points[-1]['attn_len']} "
                    f"({points[-1]['ratio']:g}x); the paper: {100 * (best_long / init_long - 1):+.1f}%.", ""]
    if clamp is not None:
        out += longmem_clamp_section(clamp, f"{rel}/longmem_clamp_wt2.png")
    if r is not None:
        out += recl_section(r, f"{rel}/recl_wt2.png", title="### RECL of the WikiText-2 group")
    out += wall_times(a, title="### Wall time of each WikiText-2 run")
    return out


def longmem_clamp_section(c: dict[str, Any], img: str) -> list[str]:
    """The second block again with relative distances clamped at the training attention length."""
    out = ["#### The same, with distances clamped at the training attention length", "",
           "With a longer memory, queries meet relative distances longer than any in training, whose encodings "
           "R(i - j) the model never learned to read. The original evaluation clamps distances (`clamp_len`: every "
           "distance beyond it shares one encoding). The same models, positions and protocol, with `clamp_len` "
           "= the training attention length, beside the unclamped perplexities above "
           f"(`python -m experiments.longmem`: `{c['command']}`, {_mins(c['wall_s'])}).", "",
           Path(c["_md"]).read_text(encoding="utf-8"), "", f"![clamped and unclamped]({img})", ""]
    verdicts = []
    for name, run in c["runs"].items():
        points = run["clamped"]
        best = min(points, key=lambda p: (p["ppl"], p["attn_len"]))
        gains = best["attn_len"] > points[0]["attn_len"] and best["gain_over_se"] > ablation.SIGNIFICANCE
        verdicts.append(f"`{name}` clamped is best at {best['attn_len']} ({best['pct_vs_train_len']:+.2f}% from its "
                        f"training length, {best['gain_over_se']:.1f} SE; {'a gain' if gains else 'no gain'}) "
                        f"and {points[-1]['pct_vs_train_len']:+.2f}% at {points[-1]['attn_len']}, against "
                        f"{run['unclamped'][-1]['pct_vs_train_len']:+.2f}% unclamped")
    out += ["*With clamped distances*: " + "; ".join(verdicts) + ".", ""]
    return out


def compressive_section(g: dict[str, Any] | None, img: str) -> list[str]:
    """A compressed memory at the same slots per layer (``experiments.compressive``, Rae et al. 2020)."""
    out = ["## 7. A compressed memory at the same fixed size (Rae et al. 2020), on the recall corpus", ""]
    if g is None:
        return out + ["Not run yet: `python -m experiments.compressive` (see its docstring).", ""]
    a = g["args"]
    out += [f"Command: `{g['command']}`.", "",
            f"The recall corpus and budget of section 6 (the relative encoding with recurrence, {a['n_layer']} "
            f"layers, segment {a['tgt_len']}, {a['steps']} steps), with two memories of the same 64 slots per layer: "
            "memory 32 and 32 compressed slots at rate 4 (`compressive-m32-c32x4`: 'conv' trained by the "
            "attention-reconstruction loss; `-max`, `-mean`: pooling; `-x3`: trained three times as many steps, "
            "not the same budget) against plain memory 64 (`plain-m64`). "
            "Each model is scored at its training memory, both memories carried.", "",
            Path(g["_md"]).read_text(encoding="utf-8"), f"![accuracy against distance, horizons marked]({img})", ""]
    plain = [m for m in g["regions"] if m.startswith("plain")]
    if plain:  # the question: past the plain model's one hop, up to the compressive one's
        lo = g["horizons"][plain[0]]["one_hop"]
        for model, rows in g["regions"].items():
            if model.startswith("compressive"):
                hi = g["horizons"][model]["one_hop"]
                past = [r for r in rows if r["lo"] >= lo and r["hi"] <= hi and r["n"]]
                base = [r for r in g["regions"][plain[0]] if r["lo"] >= lo and r["hi"] <= hi]
                out.append(f"* `{model}` between the plain horizon ({lo}) and its own ({hi}): " + ", ".join(
                               f"{r['lo']}-{r['hi'] - 1}: {100 * r['acc']:.1f} ± {100 * r['se']:.1f}% against "
                               f"{100 * b['acc']:.1f} ± {100 * b['se']:.1f}% for `{plain[0]}`"
                               for r, b in zip(past, base)) + f" (chance {100 * g['chance_accuracy']:.2f}%).")
        out.append("")
    return out


def compressive_wt2_section(g: dict[str, Any] | None, a: dict[str, Any] | None) -> list[str]:
    """The compressed memory on WikiText-2 beside ``relative-rec`` (``experiments.compressive_wt2``)."""
    out = ["### The compressed memory on WikiText-2, the same slots as `relative-rec`", ""]
    if g is None:
        return out + ["Not run yet: `python -m experiments.compressive_wt2` with the grid's flags (the command in "
                      "`experiments/compressive_wt2.py`).", ""]
    m = g.get("machine", {})
    out += [f"Command: `{g['command']}`; the WikiText-2 grid's model and budget (section 5), trained and scored on "
            f"{m.get('cpu_model', 'this machine')} (one thread) rather than the grid's machine. "
            "`relative-rec` is the grid's main row trained again here; the compressed rows keep 32 of its 64 memory "
            "slots and compress the states leaving them, 4 to 1, into 32 more ('conv', trained by the "
            "attention-reconstruction loss). Perplexity at every evaluation attention length (the long-memory "
            "sweep grows the plain memory; the compressed slots stay 32, so both rows attend to as many keys):", "",
            Path(g["_md"]).read_text(encoding="utf-8")]
    runs, cmp_, verdicts = g["runs"], g["comparisons"], g.get("verdicts", {})
    plain = runs.get("relative-rec")
    if plain is None or not cmp_:
        return out
    init, longest = str(plain["init_len"]), str(max(int(c) for c in plain["ppl"]))

    def seeds(length: str) -> str:
        return ", ".join(
            f"`{n}` {runs[n]['ppl'][length]:.2f} against `{c['against']}` {runs[c['against']]['ppl'][length]:.2f} "
            f"({c['by_length'][length]['gap_pct']:+.2f}%, {c['by_length'][length]['gap_over_se']:+.1f} SE)"
            for n, c in cmp_.items() if length in c["by_length"])

    text = [f"* At the training attention length ({init}), seed for seed: {seeds(init)}."]
    v = verdicts.get(init)
    if v:
        than = " than" if v["verdict"] in ("better", "worse") else " of"
        text.append(f"* The mean gap is {v['mean_gap_pct']:+.2f}%, and two seeds of one model differ by up to "
                    f"{v['seed_spread_pct']:.2f}%: at the same slots the compressed memory is **{v['verdict']}**{than} "
                    "the plain one on this budget.")
    w = verdicts.get(longest)
    if w:
        def lost(names: list[str]) -> float:  # mean % lost from the training length to the longest
            return sum(runs[n]["loss_pct_longest"] for n in names) / len(names)

        text.append(f"* With a longer memory at evaluation the mean gap is {w['mean_gap_pct']:+.2f}% at {longest} keys "
                    f"({w['verdict']}): {seeds(longest)}. From {init} to {longest} keys the compressed rows lose "
                    f"{lost(list(cmp_)):+.1f}% on average, the plain ones "
                    f"{lost([c['against'] for c in cmp_.values()]):+.1f}% (column '% at longest').")
    text.append("* Rae et al. report 17.1 against Transformer-XL's 18.1 perplexity on WikiText-103 (-5.5%), with "
                "far larger models, memories and budgets.")
    grid = (a or {}).get("runs", {})
    again = [f"`{n}` {runs[n]['ppl'][init]:.2f} against {grid[n]['ppl'][init]:.2f}" for n in ("relative-rec",
             "relative-rec-seed1") if n in runs and init in grid.get(n, {}).get("ppl", {})]
    if again:
        text.append(f"* The plain rows trained again here, at {init} keys, against the grid's runs of section 5 "
                    f"(another machine, an older tree): {', '.join(again)}.")
    return out + text + [""]


def longrange_section(g: dict[str, Any] | None, img: str) -> list[str]:
    """The controlled long-range experiment (``experiments.longrange``)."""
    out = ["## 6. Long-range recall under control: what the memory carries (section 3.2), and rotary positions", ""]
    if g is None:
        return out + ["Not run yet: `python -m experiments.longrange` (see its docstring for the background workers).",
                      ""]
    a, lim, c = g["args"], g["limits"], g["corpus"]
    models = ", ".join(f"`{n}`" for n in g["by_distance"])
    out += [f"Command: `{g['command']}`.", "",
            f"Corpus `recall` (`txl.data.recall`): filler words ({c['n_filler']} kinds, uniform) with definitions "
            f"`k=v`, one word ({c['n_keys']} keys, {c['n_values']} values), and, a log-uniform {c['min_distance']} "
            f"to {c['max_distance']} tokens later, the query `k v`; only the answer (the `v` after `k`) is scored, "
            f"{g['answers']:,} answers of the validation split, the same for every model (the train split draws "
            f"{100 * c.get('train_short_share', 0):.0f}% of its distances from {c['min_distance']} to "
            f"{c.get('short_distance', '-')} instead, so the lookup forms early). Chance: "
            f"{100 * g['chance_accuracy']:.2f}% accuracy, {g['chance_nll']:.2f} nats. Every model: {a['n_layer']} "
            f"layers, d_model {a['d_model']}, {a['n_head']} heads, d_inner {a['d_inner']}, dropout {a['dropout']}, "
            f"weights initialised normal(0, {a.get('init_std', 0.02)}); "
            f"{a['steps']} steps of {a['batch_size']} x {a['tgt_len']} tokens, Adam lr {a['lr']} with cosine decay; "
            f"memory {a['mem_len']} with recurrence. Models: {models} (`-seed1`: a second seed, pooled into its "
            "model's row; the standard errors are then those of the seed means). The limits of the argument: the "
            f"segment ({lim['segment']}), one hop back through memory ({lim['mem_plus_segment']}), n_layer x "
            f"mem_len ({lim['n_layer_x_mem_len']}) and n_layer x (mem_len + segment) "
            f"({lim['n_layer_x_attention']}), the farthest any cached state can reach.", ""]
    asked = [n for n in a["variants"].split(",") if n.strip()] if a["variants"] != "all" else []
    missing = [n for n in asked if n not in g["runs"]]
    if missing:
        out += [f"**Not finished:** {', '.join(f'`{n}`' for n in missing)} (asked for by the command, not trained "
                "to the end when these results were written; the same command resumes them).", ""]
    out.append(Path(g["_md"]).read_text(encoding="utf-8"))
    out += [f"![answer accuracy and loss against distance]({img})", "",
            "Accuracy (%) by region of distance, at the training memory:", ""]
    regions = next(iter(g["regions"].values()))
    out.append(common.markdown_table(
        ["model", *[f"{r['lo']}-{r['hi'] - 1}" for r in regions]],
        [[n, *[f"{100 * r['acc']:.1f} ± {100 * r['se']:.1f}" if r["n"] else "-" for r in rows]]
         for n, rows in g["regions"].items()]))
    out += ["The paper's claims on this corpus (a difference counts beyond 2 standard errors):", ""]
    out += [f"* *{f['claim']}*: {f['verdict']}." for f in g["findings"]]
    out.append("")
    return out


def rotary_wt2_section(r: dict[str, Any] | None, a: dict[str, Any] | None) -> list[str]:
    """Rotary positions beside the WikiText-2 grid's rows (``experiments.rotary``)."""
    out = ["### Rotary positions beside the paper's rows (WikiText-2)", ""]
    if r is None:
        return out + ["Not run yet: `python -m experiments.rotary --corpus wt2` with the grid's flags (the command "
                      "in `experiments/rotary.py`; about 55 min of one busy core at the grid's 0.82 s per step).", ""]
    row = r["run"]
    out += [f"Command: `{r['command']}`; trained with exactly the grid's settings, only `attn_type='rotary'` "
            "differs from `relative-rec`.", "", Path(r["_md"]).read_text(encoding="utf-8")]
    if a is not None:
        grid = r["contexts"]
        rows = [[n, *[a["runs"][n]["ppl"].get(str(c), "-") for c in grid]] for n in ("relative-rec", "shaw-rec")
                if n in a["runs"]]
        rows.append(["rotary-rec", *[row["ppl"][str(c)] for c in grid]])
        out += ["Perplexity at every attention length, beside the grid's recurrent rows:", "",
                common.markdown_table(["run", *[str(c) for c in grid]], rows)]
        out += _rotary_reading(row, a, grid)
    return out


def _rotary_reading(row: dict, a: dict, grid: list[int]) -> list[str]:
    """What the rotary row says beside relative-rec, in numbers read from the two results files."""
    train, longest = str(row["init_len"]), str(row["longest_len"])
    rel, rot = a["runs"].get("relative-rec", {}).get("ppl", {}), row["ppl"]
    if not all(k in d for d in (rel, rot) for k in (train, longest)):
        return []

    def change(ppl: dict) -> float:
        return 100 * (ppl[longest] / ppl[train] - 1)

    return [f"At the training attention length ({train}) rotary-rec reaches {rot[train]:.2f} against relative-rec's "
            f"{rel[train]:.2f} (seed 0 of each). With a longer memory at evaluation its perplexity changes by "
            f"{change(rot):+.1f}% at {longest} keys, against {change(rel):+.1f}% for relative-rec: on WikiText-2 as on "
            "the recall task of section 6, rotary matches the paper's encoding at the trained length and loses "
            "more than it when the memory grows past it.", ""]


def render(results: Path, doc: Path) -> str:
    rel = os.path.relpath(results, doc.parent)
    data = {}
    for stem in ("ablation", "recl", "char", "speedup", "ablation_wt2", "recl_wt2", "sizing_wt2",
                 "longmem_clamp_wt2", "longrange", "rotary_wt2", "compressive", "compressive_wt2"):
        d = _load(results, stem)
        if d is not None:
            d["_md"] = str(results / f"{stem}.md")
        data[stem] = d
    out = ["# Reproducing Transformer-XL's findings at small scale", "",
           "Generated by `python -m experiments.report` from `docs/results/*.json`; every number below is "
           "produced by the commands listed with it, except the paper's, which are transcribed in "
           "`experiments/paper.py`. Run the commands from the repository root with a Python that has torch, "
           "numpy and matplotlib (e.g. after `pip install -e .[cli]`). They ran on a 2-vCPU AMD EPYC (Zen 3) virtual "
           "machine without a GPU. Validation numbers throughout (as the paper's ablations).", ""]
    if data["ablation"]:
        out += ablation_section(data["ablation"], f"{rel}/ablation.png")
    if data["recl"]:
        out += recl_section(data["recl"], f"{rel}/recl.png")
    out += speedup_section(data["speedup"])
    if data["char"]:
        out += char_section(data["char"], f"{rel}/char.png")
    out += wt2_section(data["ablation_wt2"], data["recl_wt2"], data["sizing_wt2"], rel, data["longmem_clamp_wt2"])
    out += rotary_wt2_section(data["rotary_wt2"], data["ablation_wt2"])
    out += longrange_section(data["longrange"], f"{rel}/longrange.png")
    out += compressive_section(data["compressive"], f"{rel}/compressive.png")
    out += compressive_wt2_section(data["compressive_wt2"], data["ablation_wt2"])
    out += wall_times(data["ablation"], title="## Wall time of each PTB ablation run")
    out += [Path(ROOT / "experiments" / "discussion.md").read_text(encoding="utf-8")]
    text = "\n".join(out).rstrip() + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text, encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=str(common.RESULTS_DIR))
    p.add_argument("--doc", default=str(ROOT / "docs" / "results.md"))
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    render(Path(args.results), Path(args.doc))
    print(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
