"""`txl export`: one segment step of a model, memory in and out, as a torch.export program or ONNX.

    txl export --checkpoint runs/default --format torch-export -o step.pt2
    txl export --checkpoint transfo-xl/transfo-xl-wt103 --format onnx -o wt103-step.onnx

See txl.export for the program's inputs and outputs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export one segment step (memory in and out) for deployment")
    p.add_argument("--checkpoint", required=True, metavar="DIR|REPO_ID",
                   help="a model or run directory (its best checkpoint), or a Hugging Face Hub repo id")
    p.add_argument("--revision", default=None, help="Hub repo revision: branch, tag or commit (default main)")
    p.add_argument("--format", choices=["torch-export", "onnx"], default="torch-export",
                   help="torch-export: a torch.export program (.pt2), loaded by txl.export.load, run by torch; onnx: "
                   "an ONNX graph for onnxruntime and other ONNX runtimes (needs pip install 'txl[onnx]'); default "
                   "torch-export")
    p.add_argument("--output", "-o", default=None,
                   help="file to write (default: step.pt2 or step.onnx in the current directory)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import txl
    from txl.export import export
    from txl.fileio import check_output, write_output
    from txl.pretrained import resolve_model_dir

    default = "step.onnx" if args.format == "onnx" else "step.pt2"
    output = args.output or default
    check_output(output, "-o", default)  # before the model is loaded
    model = txl.from_pretrained(resolve_model_dir(args.checkpoint, revision=args.revision))
    c = model.config
    if args.format == "onnx":
        path = _write_onnx(model, Path(output))
    else:
        path = write_output(output, lambda tmp: export(model, tmp, format=args.format))
    if c.cmem_len:  # rows leave the memory in whole groups of cmem_rate: it holds up to mem_len + cmem_rate - 1
        S = c.mem_len + c.cmem_rate - 1
        print(f"{path}: one segment step ({args.format}) of {c.n_layer} layers, d_model {c.d_model}, vocab "
              f"{c.vocab_size:,}, memory {S} rows and {c.cmem_len} compressed slots at rate {c.cmem_rate}; inputs "
              f"input_ids (B, T) int64, memory ({c.n_layer}, B, {S}, {c.d_model}) float32, memory_padding (B, {S}) "
              f"bool, compressed ({c.n_layer}, B, {c.cmem_len}, {c.d_model}) float32, compressed_padding "
              f"(B, {c.cmem_len}) bool; outputs log_probs (B, T, {c.vocab_size}), new_memory, new_padding, "
              "new_compressed, new_compressed_padding; B and T dynamic")
    else:
        print(f"{path}: one segment step ({args.format}) of {c.n_layer} layers, d_model {c.d_model}, vocab "
              f"{c.vocab_size:,}, memory {c.mem_len} rows; inputs input_ids (B, T) int64, memory "
              f"({c.n_layer}, B, {c.mem_len}, {c.d_model}) float32, memory_padding (B, {c.mem_len}) bool; outputs "
              f"log_probs (B, T, {c.vocab_size}), new_memory, new_padding; B and T dynamic")
    from txl.export import onnx_sidecar

    if args.format == "onnx" and (sidecar := onnx_sidecar(path)) is not None:
        print(f"{sidecar}: the weights (over 1 GiB, too large to keep inside {path.name}); ship it beside {path.name}")
    return 0


def _write_onnx(model, output: Path) -> Path:
    """An ONNX file names its weights sidecar (``NAME.data``, large models) inside itself, so it cannot be written
    under a temporary name and renamed: it is written under its own name in a temporary directory beside
    ``output``, then moved into place, the sidecar first and the .onnx last (the output rule: all or nothing)."""
    from txl.export import export, onnx_sidecar
    from txl.fileio import WriteError

    tmpdir = None
    try:  # the temporary directory too: its failure (a full disk, a /proc) names the output, not the temporary
        tmpdir = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
        written = export(model, tmpdir / output.name, format="onnx")
        if (sidecar := onnx_sidecar(written)) is not None:
            os.replace(sidecar, output.parent / sidecar.name)
        os.replace(written, output)
    except OSError as err:
        raise WriteError(output, err, "nothing was written there") from err
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return output
