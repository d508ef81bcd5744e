"""Tiny random models for the tests: re-exported from ``pyramid_hf.testing`` (one shared vocabulary)."""

from pyramid_hf.testing import VOCAB, save_tiny_folders, tiny_model, tiny_tokenizer, tiny_trio

__all__ = ["VOCAB", "save_tiny_folders", "tiny_model", "tiny_tokenizer", "tiny_trio"]
