"""Tiny random models for the tests: re-exported from ``pyramid_hf.testing`` (one shared vocabulary)."""

from pyramid_hf.testing import VOCAB, tiny_model, tiny_tokenizer, tiny_trio

__all__ = ["VOCAB", "tiny_model", "tiny_tokenizer", "tiny_trio"]
