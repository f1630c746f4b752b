"""Data: vocabularies and tokenizers, the corpora registry, cached token arrays, the ordered iterator."""
