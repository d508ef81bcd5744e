"""Bad input gets a clear error that names the problem."""

import math

import pytest
import torch
from tiny import tiny_model

from pyramid_hf import PyramidAssistant, PyramidConfig


@pytest.mark.parametrize("kwargs,match", [
    (dict(draft_tokens=0), "draft_tokens must be a positive integer"),
    (dict(qualifier_tokens=-2), "qualifier_tokens must be a positive integer"),
    (dict(draft_tokens=2.5), "draft_tokens must be a positive integer"),
    (dict(qualifier_rule="greedy"), "qualifier_rule must be one of"),
    (dict(target_rule="assisted"), "target_rule must be one of"),
    (dict(divergence="hellinger"), "divergence must be one of"),
    (dict(target_rule="fuzzy", tau_target=0.9), "outside the range of divergence 'js'"),
    (dict(qualifier_rule="fuzzy", divergence="tv", tau_qualifier=1.5), "outside the range of divergence 'tv'"),
    (dict(qualifier_rule="fuzzy", tau_qualifier=-0.1), "outside the range"),
    (dict(tau_target=0.3), "has no effect with target_rule='exact'"),
    (dict(schedule="adaptive"), "schedule must be one of"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PyramidConfig(**kwargs)


def test_kl_allows_large_tau_and_js_max_is_ln2():
    PyramidConfig(target_rule="fuzzy", divergence="kl", tau_target=5.0)
    PyramidConfig(target_rule="fuzzy", divergence="js", tau_target=math.log(2))


def test_vocab_mismatch_between_draft_and_qualifier():
    with pytest.raises(ValueError, match="draft and qualifier have different vocabularies"):
        PyramidAssistant(tiny_model("llama", 16, 1, 0, vocab=97), tiny_model("llama", 16, 1, 0, vocab=50))


def test_vocab_mismatch_with_target(llama_trio):
    target, _, _ = llama_trio
    other = tiny_model("llama", 16, 1, 0, vocab=50)
    with pytest.raises(ValueError, match="qualifier and the target have different vocabularies"):
        target.generate(torch.tensor([[1, 2]]), assistant_model=PyramidAssistant(other), max_new_tokens=3)


def test_bad_draft_argument(llama_trio):
    _, qualifier, _ = llama_trio
    with pytest.raises(ValueError, match="draft must be a model"):
        PyramidAssistant(qualifier, "ngram")
    with pytest.raises(TypeError, match="draft must be a model"):
        PyramidAssistant(qualifier, 3)
    with pytest.raises(TypeError, match="config must be a PyramidConfig"):
        PyramidAssistant(qualifier, None, {"draft_tokens": 3})


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_beams=2), "silently ignore the assistant"),
    (dict(num_beams=2, do_sample=True), "silently ignore the assistant"),
    (dict(penalty_alpha=0.6, top_k=4), "Contrastive Search"),  # Transformers refuses it before we see it
    (dict(num_return_sequences=2, do_sample=True), "num_return_sequences=1"),
    (dict(cache_implementation="static"), "croppable dynamic cache"),
    (dict(output_attentions=True, return_dict_in_generate=True), "attentions or hidden states"),
])
def test_unsupported_generation_modes(llama_trio, kwargs, match):
    target, qualifier, draft = llama_trio
    with pytest.raises(ValueError, match=match):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=PyramidAssistant(qualifier, draft),
                        max_new_tokens=4, **kwargs)


def test_batch_size_above_one(llama_trio):
    target, qualifier, draft = llama_trio
    with pytest.raises(ValueError, match="batch size"):
        target.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), assistant_model=PyramidAssistant(qualifier, draft),
                        max_new_tokens=4)
