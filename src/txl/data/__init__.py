"""Data: vocabularies and tokenizers, the corpora registry, cached token arrays, the ordered iterator.

Training code needs three calls::

    corpus = load_corpus("ptb", data_dir="../shared/data/ptb")        # or a file / directory path
    it = OrderedIterator(corpus.train, batch_size=16, tgt_len=70, ext_len=0, var_len=True, seed=0,
                         rank=rank, world_size=world_size)
    for batch in it: ...  # batch.input_ids, batch.labels: (B / W, C + T) int64, labels -100 on context
"""

from txl.data.corpora import REGISTRY, Corpus, CorpusSpec, Download, download_corpus, load_corpus
from txl.data.iterator import IGNORE_INDEX, Batch, OrderedIterator, eval_iterator
from txl.data.tokenizer import Tokenizer, Vocab, fit_tokenizer, load_tokenizer, make_spec

__all__ = [
    "IGNORE_INDEX", "REGISTRY", "Batch", "Corpus", "CorpusSpec", "Download", "OrderedIterator",
    "Tokenizer", "Vocab", "download_corpus", "eval_iterator", "fit_tokenizer", "load_corpus",
    "load_tokenizer", "make_spec",
]
