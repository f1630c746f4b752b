"""Text conventions and vocabularies: WikiText-103 tokenisation and Hugging Face vocabulary files."""
