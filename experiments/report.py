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

ENC = ablation.ENCODING_NAMES


def _load(results: Path, stem: str) -> dict[str, Any] | None:
    file = results / f"{stem}.json"
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else None


def _defaults(add_arguments) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return vars(p.parse_args([]))


def _reduced(args: dict[str, Any], defaults: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    """The budget-relevant flags that differ from the full (default) run."""
    return [f"--{k.replace('_', '-')} {args[k]} (full: {defaults[k]})" for k in keys if args.get(k) != defaults[k]]


def _mins(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def ablation_section(a: dict[str, Any], img: str) -> list[str]:
    runs, f = a["runs"], a["findings"]
    defaults = _defaults(ablation.add_arguments)
    reduced = _reduced(a["args"], defaults, ("steps", "minutes_per_run", "batch_size", "tgt_len", "mem_len",
                                                  "valid_tokens", "contexts"))
    any_run = next(iter(runs.values()))
    m, args = any_run["model"], a["args"]
    tokens = args["steps"] * args["batch_size"] * args["tgt_len"]
    out = ["## 1. Ablation: recurrence x positional encoding (the paper's Table 6), PTB words", ""]
    if reduced:
        per_step = sum(r["train"]["train_s"] / max(1, r["train"]["steps"]) for r in runs.values())
        out += [f"**Reduced budget.** This run used {', '.join(reduced)}. The full budget is "
                "`python -m experiments.ablation` with its defaults (then `python -m experiments.recl` and "
                "`python -m experiments.report`); at this run's time per step its training would take about "
                f"{per_step * defaults['steps'] / 3600:.1f} h on this shared machine.", ""]
    out += [f"Command: `{a['command']}` (this invocation took {_mins(a['wall_s'])}: it reuses finished runs "
            "and cached losses; each run's own training and evaluation times are in the table, in seconds).", "",
            f"Every run: {m['n_layer']} layers, d_model {m['d_model']}, {m['n_head']} heads, d_inner {m['d_inner']}, "
            f"dropout {m['dropout']}, adaptive softmax cutoffs {m['cutoffs']}; {args['steps']} steps of "
            f"{args['batch_size']} x {args['tgt_len']} tokens ({tokens:,} training tokens), Adam lr {args['lr']} "
            f"with cosine decay; memory {args['mem_len']} with recurrence, 0 without. Only `attn_type` and "
            "`mem_len` differ between runs.",
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


def recl_section(r: dict[str, Any], img: str) -> list[str]:
    out = ["## 2. Relative effective context length (Appendix C)", "",
           f"Command: `{r['command']}` (wall time {_mins(r['wall_s'])}; it reuses the ablation's models and "
           "cached losses, training them first if they are missing).", "",
           f"Group: all {len(r['group'])} ablation models; contexts {r['contexts']}; threshold {r['threshold']}; "
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
    defaults = _defaults(char.add_arguments)
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


def wall_times(a: dict[str, Any] | None) -> list[str]:
    if a is None:
        return []
    rows = [[n, _mins(r["train"]["train_s"]) + (" (resumed, from its log)" if r["train"]["resumed"] else ""),
             r["train"]["steps"], r["train"]["stopped"], _mins(r["eval_wall_s"])] for n, r in a["runs"].items()]
    total = sum(r["train"]["train_s"] for r in a["runs"].values())
    return ["## Wall time of each ablation run", "",
            "Measured on the 2-core CPU described in the introduction, two runs at a time, each with `--threads 1` "
            "(`--variants` splits the grid between two processes; the listed command then reused the finished "
            "runs), so one run's time is what one core gives it. Runs interrupted by a restart of the machine "
            "resumed from their last checkpoint; their training time is estimated from the training log (the steps of "
            "each logged interval at its measured rate), as if uninterrupted. "
            "'eval' is the time spent computing that run's per-position losses at every attention length.", "",
            common.markdown_table(["run", "train", "steps", "stopped by", "eval"], rows),
            f"Training total: {_mins(total)}.", ""]


def render(results: Path, doc: Path) -> str:
    rel = os.path.relpath(results, doc.parent)
    data = {}
    for stem in ("ablation", "recl", "char", "speedup"):
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
    out += wall_times(data["ablation"])
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
