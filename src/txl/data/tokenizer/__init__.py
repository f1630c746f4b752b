"""The tokenizer: one package for text <-> ids at every level, for training data and for models.

::

    tok = fit_tokenizer(make_spec("word"), [Source(path)])           # learn a vocabulary from text
    save_tokenizer(tok, directory)                                   # txl_tokenizer.json, vocab.txt,
    tok = load_tokenizer(directory)                                  # and a Hugging Face tokenizer.json
    tok = WordTokenizer.from_hf_vocab("transfo-xl-wt103/vocab.txt")  # WikiText-103 rules included
    tok = load_model_tokenizer(checkpoint_dir)                       # whichever a model directory holds
    ids = tok.encode_prompt("The history of the city")
    stream = tok.stream()                                            # streaming detokenisation

Modules: ``vocab`` (the vocabulary), ``levels`` (byte, char, word, BPE), ``wt103`` (the WikiText-103
split/join rules of the word tokenizer), ``hf_vocab`` (Hugging Face vocabulary files, never trusting
pickle), ``stream`` (ids to text as they are generated), ``files`` (saving, loading, ``tokenizer.json``).
It is part of ``txl.data``, whose corpora are encoded with it; generation and scoring use it through
:func:`load_model_tokenizer`. (The STYLE guide's layout: ``data/`` holds the vocabulary and tokenizers.)
"""

from txl.data.tokenizer.files import hf_tokenizer, load_model_tokenizer, load_tokenizer, read_meta, save_tokenizer
from txl.data.tokenizer.levels import (
    LEVELS,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    Level,
    Tokenizer,
    WordTokenizer,
    encode_source,
    fit_tokenizer,
    make_spec,
)
from txl.data.tokenizer.stream import TextStream
from txl.data.tokenizer.vocab import Vocab

__all__ = [
    "LEVELS", "BPETokenizer", "ByteTokenizer", "CharTokenizer", "Level", "TextStream", "Tokenizer", "Vocab",
    "WordTokenizer", "encode_source", "fit_tokenizer", "hf_tokenizer", "load_model_tokenizer", "load_tokenizer",
    "make_spec", "read_meta", "save_tokenizer",
]
