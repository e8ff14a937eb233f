"""Tokenizers for a new language: train one on a corpus, extend a model's tokenizer with new tokens so
that every old token keeps its id, and compare tokenizers on held-out text (`pretrainer tokenizer`)."""
