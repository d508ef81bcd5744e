"""Feature (EAGLE-style) drafts: cache bookkeeping against a from-scratch recurrence, lossless decoding with them
(greedy token identity, sampling distribution), a perfect draft is fully accepted, files and errors."""

from __future__ import annotations

import pytest
import torch
from test_sampling import SAMPLING, _pvalues, _samples, _target_joint, sharp_trio  # noqa: F401

from pyramid_hf import FeatureDraft, PyramidAssistant, PyramidConfig
from pyramid_hf.feature_draft import FeatureDraftLevel
from pyramid_hf.feature_eval import _PathStates
from pyramid_hf.models import load_model
from pyramid_hf.stats import PyramidStats
from pyramid_hf.testing import VOCAB, tiny_model


def token_local(model):
    """Zero every attention output: each position's last hidden state then depends on its own token only."""
    for layer in model.get_decoder().layers:
        layer.self_attn.o_proj.weight.data.zero_()
    return model


def perfect_draft(qualifier):
    """For a one-layer token-local qualifier, f_{j+1} = norm(layer(e(x_{j+1}))): fc = [0 | I] and a copy of
    that layer predict it exactly."""
    draft = FeatureDraft.from_qualifier(qualifier, init_layer=0)
    draft.fc.weight.data[:, : draft.hidden_size].zero_()
    draft.embed_scale.data.fill_(1.0)
    return draft


@torch.no_grad()
def reference_logits(draft, qualifier, ids, real):
    """Logits after ids (1, L) when the first ``real`` positions have the qualifier's states, recomputed
    without any cache: later elements read the draft's own predictions, one element at a time."""
    states = draft.select_features(qualifier(input_ids=ids, output_hidden_states=True).hidden_states)
    embeds = qualifier.get_input_embeddings()(ids[:, 1:])
    features = draft.fuse_features(states[:, : min(real, ids.shape[1] - 1)])
    while True:
        predicted = draft(features, embeds[:, : features.shape[1]])
        if features.shape[1] == ids.shape[1] - 1:
            return qualifier.get_output_embeddings()(predicted[:, -1])
        features = torch.cat([features, predicted[:, -1:]], dim=1)


@pytest.mark.parametrize("arch,feature_layers", [("llama", (-1,)), ("qwen2", (-1,)), ("llama", (0, 1, -1))])
def test_cached_level_equals_the_recurrence_from_scratch(arch, feature_layers):
    qualifier = tiny_model(arch, 32, 2, seed=3)
    draft = FeatureDraft.from_qualifier(qualifier, seed=1, feature_layers=feature_layers)
    with torch.no_grad():
        draft.fc.weight.normal_(0, 0.2)  # the feature half matters
        if draft.fuse is not None:
            draft.fuse.weight.normal_(0, 0.2)  # every fused layer matters
    gen = torch.Generator().manual_seed(0)

    def states_of(path):
        hidden_states = qualifier(input_ids=path, output_hidden_states=True).hidden_states
        return _PathStates(qualifier, draft.select_features(hidden_states))

    path = torch.randint(3, VOCAB, (1, 60), generator=gen)
    states = states_of(path)
    level = FeatureDraftLevel(draft, states, PyramidStats())
    length, available, own_steps = 6, 0, 0
    for step in range(40):  # drafting rounds, verified blocks, and rejections that rewrite the tail
        if step % 4 == 3:  # a rejection at `cut`: a new token there and a new continuation after it
            cut = max(2, length - int(torch.randint(1, 4, (1,), generator=gen)))
            tail = torch.randint(3, VOCAB, (1, path.shape[1] - cut), generator=gen)
            tail[0, 0] = 3 + (int(path[0, cut]) - 2) % (VOCAB - 3)  # surely another token
            path = torch.cat([path[:, :cut], tail], dim=1)
            level.qualifier = states = states_of(path)  # the qualifier's states follow the new path
            length, available = cut + 1, min(available, cut)
        else:
            length = min(length + 1 + step % 4, path.shape[1] - 1)
        # the qualifier has read a prefix (never less of an unchanged path than before), up to all but one token
        available = min(length - 1, max(available, length - 1 - int(torch.randint(0, 3, (1,), generator=gen))))
        states.available = available
        got = level.next_token_logits(path[:, :length])
        want = reference_logits(draft, qualifier, path[:, :length], available)
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)
        own_steps += level.cached_ids.shape[1] > level.true_elements  # elements built on its own predictions
    assert own_steps >= 10


def test_no_proposal_before_the_qualifier_has_read_anything():
    qualifier = tiny_model("llama", 32, 2)
    states = _PathStates(qualifier, torch.empty(1, 0, 32))
    level = FeatureDraftLevel(FeatureDraft.from_qualifier(qualifier), states, PyramidStats())
    assert level.next_token_logits(torch.tensor([[5, 6, 7]])) is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("seed,prompt_len,new,l_d,l_q,noise", [
    (0, 4, 40, 3, 6, 0.0), (1, 9, 33, 2, 4, 0.3), (2, 1, 25, 4, 8, 1.0), (3, 6, 60, 1, 3, 0.3)])
def test_greedy_output_equals_target_alone(arch, seed, prompt_len, new, l_d, l_q, noise):
    target = tiny_model(arch, 48, 2, seed=seed + 10)
    qualifier = token_local(tiny_model(arch, 32, 1, seed=seed, init=0.3))
    draft = perfect_draft(qualifier)
    with torch.no_grad():  # noise > 0: the draft is wrong some of the time
        draft.fc.weight[:, : draft.hidden_size].normal_(0, noise / 32**0.5 if noise else 0.0)
    torch.manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, prompt_len))
    want = target.generate(input_ids=ids, max_new_tokens=new, do_sample=False)
    assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=l_d, qualifier_tokens=l_q))
    got = target.generate(input_ids=ids, max_new_tokens=new, do_sample=False, assistant_model=assistant)
    assert torch.equal(got, want)
    stats = assistant.stats
    assert stats.draft_proposed > 0 and stats.forward_calls["draft"] > 0
    if noise == 0.0:  # a perfect draft is always kept by the qualifier
        assert stats.draft_accepted == stats.draft_proposed


@pytest.mark.parametrize("arch,seed", [("llama", 0), ("qwen2", 1)])
def test_greedy_output_equals_target_alone_with_a_draft_confidence_cut(arch, seed):
    """Cut proposals leave the feature draft's cache holding fewer of its own predictions: still exact."""
    target = tiny_model(arch, 48, 2, seed=seed + 10)
    qualifier = token_local(tiny_model(arch, 32, 1, seed=seed, init=0.3))
    draft = perfect_draft(qualifier)
    with torch.no_grad():
        draft.fc.weight[:, : draft.hidden_size].normal_(0, 0.3 / 32**0.5)
    torch.manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, 6))
    want = target.generate(input_ids=ids, max_new_tokens=40, do_sample=False)
    per_round = {}
    for confidence in (0.0, 0.9):
        assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=4, qualifier_tokens=8,
                                                                     draft_confidence=confidence))
        got = target.generate(input_ids=ids, max_new_tokens=40, do_sample=False, assistant_model=assistant)
        assert torch.equal(got, want)
        per_round[confidence] = assistant.stats.draft_proposed / assistant.stats.inner_rounds
    assert per_round[0.9] < per_round[0.0]


@pytest.mark.parametrize("arch,seed", [("llama", 0), ("qwen2", 1)])
def test_greedy_output_equals_target_alone_with_fused_layers(arch, seed):
    target = tiny_model(arch, 48, 2, seed=seed + 10)
    qualifier = tiny_model(arch, 32, 3, seed=seed, init=0.3)
    draft = FeatureDraft.from_qualifier(qualifier, seed=seed, feature_layers=(1, 2, -1))
    with torch.no_grad():
        draft.fuse.weight.add_(torch.randn_like(draft.fuse.weight) * 0.2)
    torch.manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, 5))
    want = target.generate(input_ids=ids, max_new_tokens=40, do_sample=False)
    assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=3, qualifier_tokens=6))
    got = target.generate(input_ids=ids, max_new_tokens=40, do_sample=False, assistant_model=assistant)
    assert torch.equal(got, want)
    assert assistant.stats.draft_proposed > 0 and assistant.stats.forward_calls["draft"] > 0


def test_a_new_multi_layer_draft_starts_as_the_one_layer_draft():
    qualifier = tiny_model("qwen2", 32, 3, seed=2)
    one = FeatureDraft.from_qualifier(qualifier, seed=4)
    several = FeatureDraft.from_qualifier(qualifier, seed=4, feature_layers=(0, 2, -1))
    assert one.fuse is None and several.fuse.weight.shape == (32, 96)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden_states = qualifier(input_ids=ids, output_hidden_states=True).hidden_states
        embeds = qualifier.get_input_embeddings()(ids)
        selected = several.select_features(hidden_states)
        assert selected.shape == (1, 12, 96)
        rms = selected[..., :64].pow(2).mean(-1).sqrt()  # earlier layers arrive RMS-normalised
        torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(several(several.fuse_features(selected), embeds),
                                   one(one.fuse_features(one.select_features(hidden_states)), embeds))


@pytest.mark.parametrize("layers,message", [((5,), "indices into the qualifier's 3 hidden states"),
                                            ((), "indices"), ((2, -1), "names one hidden state twice")])
def test_bad_feature_layers_are_refused(layers, message):
    with pytest.raises(ValueError, match=message):
        FeatureDraft.from_qualifier(tiny_model("llama", 32, 2), feature_layers=layers)


def test_sampling_follows_the_target_distribution(sharp_trio):  # noqa: F811
    target, _, _ = sharp_trio
    qualifier = token_local(tiny_model("llama", 16, 1, 1, vocab=8, init=0.5))
    draft = perfect_draft(qualifier)
    with torch.no_grad():
        draft.fc.weight[:, :16].normal_(0, 0.1)
    assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=2, qualifier_tokens=2))
    pvals = _pvalues(_samples(target, assistant), _target_joint(target))
    assert min(pvals) > 1e-3, pvals
    assert assistant.total_stats.draft_accepted > 0 and assistant.total_stats.draft_proposed > \
        assistant.total_stats.draft_accepted


def test_save_load_round_trip_and_load_model(tmp_path):
    qualifier = tiny_model("qwen2", 32, 2)
    draft = FeatureDraft.from_qualifier(qualifier)
    with torch.no_grad():
        draft.fc.weight.normal_(0, 0.1)
    folder = draft.save(tmp_path / "d", note="test")
    assert {"config.json", "feature_draft.json", "feature_draft.safetensors"} <= {p.name for p in folder.iterdir()}
    loaded = load_model(str(folder), dtype="float32")
    assert isinstance(loaded.model, FeatureDraft) and loaded.model.meta["note"] == "test"
    f, e = torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    torch.testing.assert_close(loaded.model(f, e), draft(f, e))
    assert FeatureDraft.load(folder).fc.weight.dtype == torch.float32  # the stored dtype by default


def test_a_multi_layer_draft_round_trips(tmp_path):
    qualifier = tiny_model("llama", 32, 2)
    draft = FeatureDraft.from_qualifier(qualifier, feature_layers=(1, -1))
    with torch.no_grad():
        draft.fuse.weight.normal_(0, 0.1)
    loaded = FeatureDraft.load(draft.save(tmp_path / "d"))
    assert loaded.feature_layers == (1, -1)
    selected = torch.randn(1, 5, 64)
    torch.testing.assert_close(loaded.fuse_features(selected), draft.fuse_features(selected))


def test_a_draft_for_another_qualifier_width_is_refused():
    draft = FeatureDraft.from_qualifier(tiny_model("llama", 32, 2))
    with pytest.raises(ValueError, match="width 32.*64 wide"):
        PyramidAssistant(tiny_model("llama", 64, 2), draft)


def test_a_draft_reading_layers_the_qualifier_lacks_is_refused(tmp_path):
    qualifier = tiny_model("llama", 32, 3)
    draft = FeatureDraft.load(FeatureDraft.from_qualifier(qualifier, feature_layers=(2, -1)).save(tmp_path / "d"))
    PyramidAssistant(qualifier, draft)  # the qualifier it was built for: accepted
    with pytest.raises(ValueError, match=r"names one hidden state twice: \[2, -1\]"):  # 2 is the final state here
        PyramidAssistant(tiny_model("llama", 32, 2), draft)
    with pytest.raises(ValueError, match=r"indices into the qualifier's 2 hidden states .*got \[2, -1\]"):
        PyramidAssistant(tiny_model("llama", 32, 1), draft)


def test_a_folder_of_another_format_is_refused(tmp_path):
    draft = FeatureDraft.from_qualifier(tiny_model("llama", 32, 2))
    folder = draft.save(tmp_path / "d")
    (folder / "feature_draft.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="unknown format"):
        FeatureDraft.load(folder)
