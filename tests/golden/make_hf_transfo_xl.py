"""Write tests/golden/hf_transfo_xl_tiny/: a tiny Transformer-XL saved exactly as a Hugging Face Hub repo is.

The oracle writes it: ``transformers`` 4.37.2 ``TransfoXLLMHeadModel.save_pretrained`` and
``TransfoXLTokenizer.save_pretrained`` (config.json, generation_config.json, model.safetensors, vocab.pkl,
tokenizer_config.json, special_tokens_map.json, added_tokens.json). The files are checked in, so the suite
reads them without the oracle; tests/test_pretrained.py regenerates them when ``transformers`` is importable
and checks they are unchanged. Run it in the oracle's environment (``.ci/run`` builds one):

    PYTHONHASHSEED=0 python tests/golden/make_hf_transfo_xl.py [OUT_DIR]   # default: tests/golden/hf_transfo_xl_tiny

(PYTHONHASHSEED=0: vocab.pkl holds sets, pickled in hash order; with it the files are byte-identical.)
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parent / "hf_transfo_xl_tiny"
WORDS = "<eos> <unk> the cat sat on a mat . dog = Valkyria".split()


def write_repo(out: Path) -> None:
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel, TransfoXLTokenizer

    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:  # a relative vocab_file: the pickle records the name given
        os.chdir(tmp)
        try:
            Path("vocab.txt").write_text("".join(w + "\n" for w in WORDS), encoding="utf-8")
            tokenizer = TransfoXLTokenizer(vocab_file="vocab.txt")
        finally:
            os.chdir(cwd)
    torch.manual_seed(0)
    # The published wt103 checkpoint's evaluation context: mem_len 1600, clamp_len 1000, same_length.
    config = TransfoXLConfig(vocab_size=len(WORDS), cutoffs=[], d_model=16, d_embed=16, n_head=2, d_head=8,
                             d_inner=32, div_val=1, n_layer=2, mem_len=1600, clamp_len=1000, same_length=True,
                             dropout=0.0, dropatt=0.0)
    model = TransfoXLLMHeadModel(config).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    write_repo(Path(sys.argv[1]) if len(sys.argv) > 1 else GOLDEN)
