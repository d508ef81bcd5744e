"""Derived drafts: `cut_layers` keeps any subset of decoder layers with config and weights consistent."""

import pytest
import torch
from tiny import VOCAB, tiny_model
from transformers import AutoModelForCausalLM

from pyramid_hf.derive import cut_layers, decoder_layers_name


def _ids(seed=0, n=9):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [True, False])
def test_keeping_every_layer_changes_nothing(arch, tied):
    model = tiny_model(arch, layers=4, seed=3, tie_word_embeddings=tied)
    cut = cut_layers(model, range(4))
    with torch.no_grad():
        assert torch.equal(cut(_ids()).logits, model(_ids()).logits)
    assert cut.config.num_hidden_layers == 4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("keep", [[0, 2], [1, 3], [3], [0, 1, 3]])
def test_a_subset_equals_the_original_with_the_other_layers_skipped(arch, keep):
    model = tiny_model(arch, layers=4, seed=4)
    cut = cut_layers(model, keep)
    layers = model.get_submodule(decoder_layers_name(model))
    hooks = [layers[i].register_forward_hook(lambda mod, args, out: args[0]) for i in range(4) if i not in keep]
    try:
        with torch.no_grad():
            expected = model(_ids(1), use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        assert torch.allclose(cut(_ids(1), use_cache=False).logits, expected, atol=1e-6)
    assert cut.config.num_hidden_layers == len(keep)
    layer_types = getattr(cut.config, "layer_types", None)
    assert layer_types is None or len(layer_types) == len(keep)
    assert cut.config.pyramid_kept_layers == keep


def test_cache_is_indexed_by_the_new_layer_positions():
    cut = cut_layers(tiny_model("qwen2", layers=4, seed=5), [1, 3])
    with_cache = cut.generate(_ids(2), do_sample=False, max_new_tokens=12)
    without = cut.generate(_ids(2), do_sample=False, max_new_tokens=12, use_cache=False)
    assert torch.equal(with_cache, without)


def test_dtype_ties_and_reload(tmp_path):
    tiny_model("llama", layers=3, seed=6, tie_word_embeddings=True).save_pretrained(tmp_path / "full")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full", dtype=torch.bfloat16)
    cut = cut_layers(model, [0, -1])
    assert all(p.dtype == torch.bfloat16 for p in cut.parameters())
    assert cut.lm_head.weight.data_ptr() == cut.get_input_embeddings().weight.data_ptr()
    assert cut.get_input_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    cut.save_pretrained(tmp_path / "cut")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "cut", dtype=torch.bfloat16)
    assert reloaded.config.num_hidden_layers == 2 and reloaded.config.pyramid_kept_layers == [0, 2]
    with torch.no_grad():
        assert torch.equal(reloaded(_ids(3)).logits, cut(_ids(3)).logits)


def test_untied_heads_stay_untied():
    cut = cut_layers(tiny_model("qwen2", layers=3, seed=7, tie_word_embeddings=False), 2)
    assert cut.lm_head.weight.data_ptr() != cut.get_input_embeddings().weight.data_ptr()
    assert cut.config.num_hidden_layers == 2 and cut.config.pyramid_kept_layers == [0, 1]


@pytest.mark.parametrize("keep,match", [([], "at least one"), ([0, 5], "out of range"), ("ab", "layer indices")])
def test_bad_keep(keep, match):
    with pytest.raises(ValueError, match=match):
        cut_layers(tiny_model("llama", layers=3), keep)


def test_cli_derive(tmp_path):
    from pyramid_hf.cli import main
    from pyramid_hf.testing import tiny_tokenizer

    tiny_model("qwen2", layers=4, seed=8).save_pretrained(tmp_path / "full")
    tiny_tokenizer().save_pretrained(tmp_path / "full")
    assert main(["derive", "--model", str(tmp_path / "full"), "--keep_layers", "0,3", "--out", str(tmp_path / "cut"),
                 "--dtype", "float32"]) == 0
    cut = AutoModelForCausalLM.from_pretrained(tmp_path / "cut")
    assert cut.config.num_hidden_layers == 2 and cut.config.pyramid_kept_layers == [0, 3]
    assert (tmp_path / "cut" / "tokenizer.json").is_file()
    assert main(["derive", "--model", str(tmp_path / "full"), "--keep_layers", "x", "--out", str(tmp_path / "b")]) == 2
