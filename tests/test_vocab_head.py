"""Reduced-vocabulary draft heads: same logits on kept ids, -inf elsewhere, and still lossless under exact rules."""

import json
import math

import pytest
import torch
from test_sampling import SAMPLES, _pvalues, _samples, _target_joint, sharp_trio  # noqa: F401 (fixture)
from tiny import VOCAB, save_tiny_folders, tiny_model, tiny_tokenizer, tiny_trio
from torch import nn
from transformers import AutoTokenizer

from pyramid_hf import PyramidAssistant, PyramidConfig
from pyramid_hf.cli import main
from pyramid_hf.models import load_model
from pyramid_hf.vocab_head import (
    SIDECAR,
    ReducedVocabHead,
    apply_reduced_vocab,
    coverage,
    load_reduced_vocab,
    select_vocab,
    token_counts,
)

KEPT = torch.tensor(sorted({0, 1, 2} | set(range(3, VOCAB, 2))))  # pad/eos/unk and every other id


def _ids(seed, n=7):
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [True, False])
def test_kept_logits_equal_the_full_head_and_the_rest_is_minus_inf(arch, tied):
    model = tiny_model(arch, layers=2, seed=1, tie_word_embeddings=tied)
    with torch.no_grad():
        full = model(_ids(0)).logits
    embeddings_before = model.get_input_embeddings().weight.clone()
    apply_reduced_vocab(model, KEPT)
    model.tie_weights()  # must not re-tie (or overwrite) the kept rows
    assert isinstance(model.get_output_embeddings(), ReducedVocabHead)
    with torch.no_grad():
        reduced = model(_ids(0)).logits
    assert reduced.shape == full.shape
    assert torch.allclose(reduced[..., KEPT], full[..., KEPT], atol=1e-6)
    dropped = torch.ones(VOCAB, dtype=torch.bool)
    dropped[KEPT] = False
    assert torch.isneginf(reduced[..., dropped]).all()
    assert torch.equal(model.get_input_embeddings().weight, embeddings_before)
    assert model.config.tie_word_embeddings is False


def test_select_vocab_keeps_the_most_frequent_and_the_always_kept():
    counts = torch.tensor([0, 0, 5, 9, 1, 7, 0, 3])
    kept = select_vocab(counts, 4, always_keep=[1])
    assert kept.tolist() == [1, 2, 3, 5]
    assert coverage(counts, kept) == pytest.approx(21 / 25)
    with pytest.raises(ValueError, match="reduced vocabulary size"):
        select_vocab(counts, 9)
    with pytest.raises(ValueError, match="reduced vocabulary size"):
        select_vocab(counts, 1, always_keep=[1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        select_vocab(counts, 4, always_keep=[8])


def test_bad_heads_and_ids_are_refused():
    with pytest.raises(ValueError, match="repeated"):
        ReducedVocabHead(nn.Linear(4, 8, bias=False), torch.tensor([1, 1, 2]))
    with pytest.raises(ValueError, match=r"ids in \[0, 8\)"):
        ReducedVocabHead(nn.Linear(4, 8, bias=False), torch.tensor([1, 8]))
    model = apply_reduced_vocab(tiny_model("llama", layers=1), KEPT)
    with pytest.raises(ValueError, match="already has a reduced"):
        apply_reduced_vocab(model, KEPT)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qualifier_rule", ["exact", "assisted"])
@pytest.mark.parametrize("seed,max_new,l_d,l_q", [(0, 1, 1, 1), (1, 19, 3, 5), (2, 40, 4, 8)])
def test_pyramid_with_reduced_heads_matches_target_greedy(arch, qualifier_rule, seed, max_new, l_d, l_q):
    target, qualifier, draft = tiny_trio(arch, seed=20 + seed)
    apply_reduced_vocab(draft, KEPT)
    apply_reduced_vocab(qualifier, KEPT[::2])  # the qualifier too: the target alone decides what is emitted
    expected = target.generate(_ids(seed), do_sample=False, max_new_tokens=max_new)
    assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=l_d, qualifier_tokens=l_q,
                                                                 qualifier_rule=qualifier_rule))
    got = target.generate(_ids(seed), assistant_model=assistant, do_sample=False, max_new_tokens=max_new)
    assert torch.equal(got, expected), f"{got.tolist()} != {expected.tolist()}"


def test_fuzzy_rules_handle_the_zeros_of_a_reduced_draft():
    """KL(p_qualifier || q_draft) is infinite when q is zero where p is not: every proposal is rejected. JS and TV
    stay finite (no NaN): at their upper bound every proposal is kept."""
    target, qualifier, draft = tiny_trio("llama", seed=30)
    apply_reduced_vocab(draft, KEPT)
    for divergence, tau, all_kept in (("kl", 0.3, False), ("js", math.log(2.0), True), ("tv", 1.0, True)):
        assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=3, qualifier_tokens=4,
                                                                     qualifier_rule="fuzzy", divergence=divergence,
                                                                     tau_qualifier=tau))
        out = target.generate(_ids(3), assistant_model=assistant, do_sample=False, max_new_tokens=24)
        assert out.shape[1] == 7 + 24
        stats = assistant.stats
        assert stats.draft_proposed > 0
        assert stats.draft_accepted == (stats.draft_proposed if all_kept else 0), (divergence, stats.draft_accepted)


def test_sampling_with_a_reduced_draft_matches_the_target_distribution(sharp_trio):  # noqa: F811
    target, qualifier, draft = sharp_trio
    draft = apply_reduced_vocab(tiny_model("llama", 16, 1, 2, vocab=8, init=0.5), torch.tensor([0, 2, 3, 5, 6]))
    assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=2, qualifier_tokens=2))
    pvals = _pvalues(_samples(target, assistant), _target_joint(target))
    assert min(pvals) > 1e-3, pvals
    assert assistant.total_stats.draft_accepted > 0 and assistant.total_stats.target_calls > SAMPLES


def test_reduce_vocab_command_writes_a_sidecar_that_load_model_applies(tmp_path, capsys):
    from datasets import Dataset

    tokenizer = tiny_tokenizer()
    model = tiny_model("qwen2", layers=2, seed=4, tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "draft")
    tokenizer.save_pretrained(tmp_path / "draft")
    texts = ["def f ( x ) : return x + 1", "for i in range ( 3 ) : print ( i )", "if a : pass"] * 3
    Dataset.from_dict({"prompt": texts}).save_to_disk(tmp_path / "texts")
    rc = main(["reduce-vocab", "--model", str(tmp_path / "draft"), "--vocab_size", "24", "--texts",
               str(tmp_path / "texts"), "--out", str(tmp_path / "draft-24")])
    assert rc == 0
    sidecar = json.loads((tmp_path / "draft-24" / SIDECAR).read_text())
    kept = load_reduced_vocab(tmp_path / "draft-24")
    assert sidecar["size"] == 24 == kept.numel() and sidecar["coverage"] == 1.0
    folder_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "draft")  # what the command counts with
    counts = token_counts(folder_tokenizer, texts, VOCAB)
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(kept.tolist())
    assert {0, 1, 2} <= set(kept.tolist())  # pad, eos, unk: the draft can always stop
    reduced = load_model(str(tmp_path / "draft-24"), dtype="float32").model
    full = load_model(str(tmp_path / "draft-24"), dtype="float32", reduced_vocab=False).model
    assert isinstance(reduced.get_output_embeddings(), ReducedVocabHead)
    assert isinstance(full.get_output_embeddings(), nn.Linear)
    with torch.no_grad():
        assert torch.allclose(reduced(_ids(5)).logits[..., kept], full(_ids(5)).logits[..., kept], atol=1e-6)
    assert main(["reduce-vocab", "--model", str(tmp_path / "texts"), "--out", str(tmp_path / "x")]) == 2
    assert "not a model folder" in capsys.readouterr().err
    (tmp_path / "draft-24" / SIDECAR).write_text("{not json")
    with pytest.raises(ValueError, match="not a valid reduced-vocabulary file"):
        load_reduced_vocab(tmp_path / "draft-24")


def test_load_trio_gives_the_qualifier_a_reduced_head_and_an_ngram_draft(tmp_path, monkeypatch):
    from pyramid_hf.ngram_draft import CorpusNgramDraft
    from pyramid_hf.trio import load_trio

    monkeypatch.setenv("PYRAMID_HF_CACHE", str(tmp_path / "cache"))
    target, qualifier, _ = tiny_trio("qwen2", seed=6)
    save_tiny_folders(tmp_path, target=target, qualifier=qualifier)
    trio = load_trio(None, target=str(tmp_path / "target"), qualifier=str(tmp_path / "qualifier"), draft="ngram",
                     dtype="float32", qualifier_vocab_size=24)
    head = trio.qualifier.get_output_embeddings()
    assert isinstance(head, ReducedVocabHead) and head.kept_ids.numel() == 24
    assert "LM head over 24 tokens" in trio.origins["qualifier"]
    sidecars = list((tmp_path / "cache" / "vocab").glob(f"*/{SIDECAR}"))
    assert len(sidecars) == 1 and load_reduced_vocab(sidecars[0].parent).tolist() == head.kept_ids.tolist()
    assert isinstance(trio.draft, CorpusNgramDraft) and not trio.has_model_draft
    assert list((tmp_path / "cache" / "ngram").glob("*.npz"))
    ids = _ids(8, 5)
    expected = trio.target.generate(ids, do_sample=False, max_new_tokens=20)
    got = trio.target.generate(ids, do_sample=False, max_new_tokens=20, assistant_model=PyramidAssistant(
        trio.qualifier, trio.draft, PyramidConfig(draft_tokens=3, qualifier_tokens=4)))
    assert torch.equal(got, expected)
    again = load_trio(None, target=str(tmp_path / "target"), qualifier=str(tmp_path / "qualifier"), draft="none",
                      dtype="float32", qualifier_vocab_size=24)  # the cached ids, the same head
    assert again.qualifier.get_output_embeddings().kept_ids.tolist() == head.kept_ids.tolist()
    sidecars[0].write_text("{half written")
    recount = load_trio(None, target=str(tmp_path / "target"), qualifier=str(tmp_path / "qualifier"), draft="none",
                        dtype="float32", qualifier_vocab_size=24)
    assert recount.qualifier.get_output_embeddings().kept_ids.tolist() == head.kept_ids.tolist()
    with pytest.raises(ValueError, match="qualifier_vocab_size must be a non-negative integer"):
        load_trio(None, target=str(tmp_path / "target"), qualifier=str(tmp_path / "qualifier"), draft="none",
                  dtype="float32", qualifier_vocab_size=-3)
