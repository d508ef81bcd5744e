"""The Hub `custom_generate` folder, loaded from a local folder as Transformers loads it from a repo."""

import shutil
from pathlib import Path

import pytest
import torch
from tiny import VOCAB, tiny_model, tiny_trio
from transformers import TextIteratorStreamer

from pyramid_hf.testing import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The folder as it lands on the Hub: symlinks to the package's modules become plain files."""
    repo = tmp_path_factory.mktemp("pyramid-sd")
    shutil.copytree(ROOT / "custom_generate", repo / "custom_generate", symlinks=False)
    assert not any(p.is_symlink() for p in (repo / "custom_generate").iterdir())
    return str(repo)


def _prompt(seed, length=6):
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("draft", ["model", "prompt_lookup", None])
@pytest.mark.parametrize("seed,max_new,l_d,l_q", [(0, 1, 1, 1), (1, 17, 3, 5), (2, 30, 4, 8)])
def test_matches_target_greedy(published, draft, seed, max_new, l_d, l_q):
    target, qualifier, draft_model = tiny_trio("llama", seed=seed)
    draft = draft_model if draft == "model" else draft
    ids = _prompt(seed)
    expected = target.generate(ids, do_sample=False, max_new_tokens=max_new)
    stats = {}
    got = target.generate(ids, do_sample=False, max_new_tokens=max_new, custom_generate=published,
                          trust_remote_code=True, qualifier_model=qualifier, draft_model=draft,
                          draft_tokens=l_d, qualifier_tokens=l_q, pyramid_stats=stats)
    assert torch.equal(got, expected)
    assert stats["new_tokens"] == max_new
    assert stats["forward_calls"]["target"] >= 1


def test_repository_folder_itself_loads(tmp_path):
    """The checked-in folder (with its symlinks) is what a local clone loads."""
    target, qualifier, draft = tiny_trio("qwen2", seed=3)
    ids = _prompt(3)
    expected = target.generate(ids, do_sample=False, max_new_tokens=12)
    got = target.generate(ids, do_sample=False, max_new_tokens=12, custom_generate=str(ROOT), trust_remote_code=True,
                          qualifier_model=qualifier, draft_model=draft)
    assert torch.equal(got, expected)


def test_sampling_fuzzy_and_streamer(published):
    target, qualifier, draft = tiny_trio("llama", seed=4)
    tokenizer = tiny_tokenizer()
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    torch.manual_seed(0)
    out = target.generate(_prompt(4), do_sample=True, temperature=0.8, top_k=20, max_new_tokens=10,
                          custom_generate=published, trust_remote_code=True, qualifier_model=qualifier,
                          draft_model=draft, qualifier_rule="fuzzy", target_rule="fuzzy", tau_qualifier=0.2,
                          tau_target=0.3, streamer=streamer)
    assert out.shape == (1, 16)
    streamed = "".join(streamer)
    assert streamed == tokenizer.decode(out[0, 6:])


def test_needs_trust_remote_code(published):
    target, qualifier, _ = tiny_trio("llama")
    with pytest.raises(ValueError, match="trust_remote_code"):
        target.generate(_prompt(0), max_new_tokens=2, custom_generate=published, qualifier_model=qualifier)


@pytest.mark.parametrize("kwargs,match", [
    ({}, "needs qualifier_model"),
    ({"qualifier_model": "Q", "num_beams": 2}, "num_beams=2"),
    ({"qualifier_model": "Q", "num_return_sequences": 2}, "num_return_sequences=2"),
    ({"qualifier_model": "Q", "draft_model": "ngrams"}, "draft_model must be"),
    ({"qualifier_model": "Q", "draft_tokens": 0}, "draft_tokens must be a positive integer"),
    ({"qualifier_model": "small_vocab"}, "different vocabularies"),
])
def test_bad_input(published, kwargs, match):
    target, qualifier, _ = tiny_trio("llama")
    if kwargs.get("qualifier_model") == "Q":
        kwargs["qualifier_model"] = qualifier
    elif kwargs.get("qualifier_model") == "small_vocab":
        kwargs["qualifier_model"] = tiny_model(vocab=VOCAB - 10)
    with pytest.raises(ValueError, match=match):
        target.generate(_prompt(0), max_new_tokens=2, custom_generate=published, trust_remote_code=True, **kwargs)


def test_folder_holds_every_module_it_imports():
    """Transformers resolves the folder's relative imports statically: a module missing here breaks Hub users."""
    import re
    folder = ROOT / "custom_generate"
    for module in folder.glob("*.py"):
        for name in re.findall(r"^\s*from \.(\w+) import", module.read_text(), flags=re.M):
            assert (folder / f"{name}.py").exists(), f"custom_generate/{module.name} imports .{name}: link it"
