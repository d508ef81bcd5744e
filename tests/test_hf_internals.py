"""The private Transformers APIs wrapped in pyramid_hf._hf: fail loudly if their signatures change."""

import pytest
import torch
from transformers.generation.utils import GenerationMixin

import pyramid_hf  # noqa: F401  (installs the wrappers)
from pyramid_hf import _hf


def test_installed_transformers_matches_expected_signatures():
    _hf.check_signatures()  # raises RuntimeError on any change


def test_wrappers_installed_once():
    _hf.install()
    _hf.install()
    for name in _hf.EXPECTED_SIGNATURES:
        wrapped = getattr(GenerationMixin, name)
        assert hasattr(wrapped, "__pyramid_original__")
        assert not hasattr(wrapped.__pyramid_original__, "__pyramid_original__")


def test_a_changed_signature_is_detected(monkeypatch):
    def changed(self, input_ids, logits_processor, new_argument, **model_kwargs):
        pass

    monkeypatch.setattr(GenerationMixin, "_assisted_decoding", changed)
    with pytest.raises(RuntimeError, match="_assisted_decoding changed its parameters"):
        _hf.check_signatures()


def test_plain_assisted_generation_is_untouched(llama_trio):
    """A normal assistant model still goes through Transformers' own code path."""
    target, qualifier, _ = llama_trio
    ids = torch.tensor([[5, 6, 7]])
    plain = target.generate(ids, do_sample=False, max_new_tokens=10)
    assisted = target.generate(ids, assistant_model=qualifier, do_sample=False, max_new_tokens=10)
    assert torch.equal(plain, assisted)
