"""The feature store: the qualifier's states of training blocks kept in a folder that later runs reuse, keyed by
what they depend on, and never read back from a half-written or foreign folder."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_feature_train import _texts
from transformers import TrainingArguments

from pyramid_hf import FeatureDraft
from pyramid_hf.feature_store import FeatureStore
from pyramid_hf.feature_train import FeatureDistillation, FeatureDraftArguments, load_texts, text_blocks, train
from pyramid_hf.testing import VOCAB, tiny_model, tiny_tokenizer


def _blocks(count=6, length=12, seed=0):
    return torch.randint(3, VOCAB, (count, length), generator=torch.Generator().manual_seed(seed)).tolist()


def _states(blocks, width, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(len(blocks), len(blocks[0]), width, generator=gen)


def test_a_folder_store_is_read_back_by_a_later_run_and_keyed_by_what_the_states_depend_on(tmp_path):
    qualifier = tiny_model("qwen2", 32, 2)
    draft = FeatureDraft.from_qualifier(qualifier, feature_layers=(1, -1))
    blocks = _blocks()
    store = FeatureStore.for_draft(draft, qualifier, blocks, tmp_path)
    selected = _states(blocks[:2], 64)
    store.put([3, 5], selected, selected[..., 32:])
    again = FeatureStore.for_draft(draft, qualifier, blocks, tmp_path)  # a later run
    assert again.folder == store.folder and again.stored_blocks() == [3, 5]
    got_selected, got_final = again.get([5, 3])
    torch.testing.assert_close(got_selected, selected[[1, 0]], rtol=0, atol=0)
    torch.testing.assert_close(got_final, selected[[1, 0], :, 32:], rtol=0, atol=0)
    assert again.get([3, 4]) is None  # block 4 was never stored
    meta = json.loads((store.folder / "meta.json").read_text())
    assert meta["feature_layers"] == [1, -1] and meta["final_part"] == 1 and meta["blocks"] == 6

    other_text = FeatureStore.for_draft(draft, qualifier, _blocks(seed=1), tmp_path)
    with torch.no_grad():
        tuned = tiny_model("qwen2", 32, 2)
        tuned.model.layers[1].mlp.down_proj.weight.mul_(1.01)  # the same architecture, tuned
    other_model = FeatureStore.for_draft(draft, tuned, blocks, tmp_path)
    other_layers = FeatureStore.for_draft(FeatureDraft.from_qualifier(qualifier, feature_layers=(0, -1)),
                                          qualifier, blocks, tmp_path)
    folders = {store.folder, other_text.folder, other_model.folder, other_layers.folder}
    assert len(folders) == 4 and all(s.stored_blocks() == [] for s in (other_text, other_model, other_layers))


def test_a_store_without_the_final_state_among_its_parts_keeps_it_apart(tmp_path):
    blocks = _blocks()
    store = FeatureStore(len(blocks), 12, 8, 2, None, torch.bfloat16, tmp_path / "s")
    selected, final = _states(blocks[:1], 16), _states(blocks[:1], 8, seed=2)
    store.put([0], selected, final)
    got_selected, got_final = FeatureStore(len(blocks), 12, 8, 2, None, torch.bfloat16, tmp_path / "s").get([0])
    assert got_selected.dtype == torch.bfloat16 and (tmp_path / "s" / "final.bin").is_file()
    torch.testing.assert_close(got_selected, selected.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(got_final, final.bfloat16(), rtol=0, atol=0)


def test_damaged_or_foreign_folders_are_never_read(tmp_path):
    folder = tmp_path / "s"
    store = FeatureStore(4, 12, 8, 1, 0, torch.float32, folder)
    store.put([0, 1], _states(_blocks(2), 8), None)
    with open(folder / "selected.bin", "r+b") as f:  # a copy cut short
        f.truncate(100)
    reopened = FeatureStore(4, 12, 8, 1, 0, torch.float32, folder)
    assert reopened.stored_blocks() == [] and reopened.get([0]) is None
    with pytest.raises(ValueError, match=r"written for other states \(blocks, hidden"):
        FeatureStore(5, 12, 16, 1, 0, torch.float32, folder)
    with pytest.raises(ValueError, match="final_part must name one of the 2"):
        FeatureStore(4, 12, 8, 2, 2, torch.float32)
    with pytest.raises(ValueError, match="cannot store torch.int8 states"):
        FeatureStore(4, 12, 8, 1, 0, torch.int8)


def test_a_continued_run_reads_the_first_runs_states_from_the_folder(tmp_path, monkeypatch):
    qualifier, tokenizer = tiny_model("llama", 32, 2), tiny_tokenizer()
    forwards = []
    read = FeatureDistillation._qualifier_features
    monkeypatch.setattr(FeatureDistillation, "_qualifier_features",
                        lambda self, ids, mask: forwards.append(len(ids)) or read(self, ids, mask))
    args = FeatureDraftArguments(texts=str(_texts(tmp_path / "texts")), block_size=32, vocab_size=None,
                                 feature_cache_dir=str(tmp_path / "states"))
    assert args.cache_features  # a folder implies the cache
    blocks = len(text_blocks(tokenizer, load_texts(args), 32))
    epoch = math.ceil(blocks / 2)
    training_args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=epoch, per_device_train_batch_size=2,
                                      save_steps=1000, report_to="none", use_cpu=True, learning_rate=1e-3)
    first = train(args, training_args, qualifier=qualifier, tokenizer=tokenizer)
    assert len(forwards) == epoch  # every block read once
    args.init_from, training_args.output_dir = str(first), str(tmp_path / "continued")
    training_args.max_steps = 3
    train(args, training_args, qualifier=qualifier, tokenizer=tokenizer)
    assert len(forwards) == epoch  # the continued run read every block from the folder
