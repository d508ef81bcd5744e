"""`pyramid-sd write-completions`: a model's own completions, batched with left padding, equal its unbatched greedy
ones; interrupted files resume; the feature-draft trainer reads them."""

from __future__ import annotations

import json

import pytest
import torch

from pyramid_hf.cli import main
from pyramid_hf.completions import WriteCompletionsArgs, batching_order, read_completions, write_completions
from pyramid_hf.feature_train import FeatureDraftArguments, load_texts
from pyramid_hf.testing import tiny_model, tiny_tokenizer

PROMPTS = ["def f ( x ) :", "for i in range ( 3 ) : print ( i )", "class a :", "if x : return None else :",
           "import os", "while True : pass"]


def _greedy_alone(model, tokenizer, prompt, max_new_tokens):
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_prompts_are_sorted_by_length_only_within_windows():
    lengths = [5, 1, 9, 3, 8, 2, 7]
    order = batching_order(lengths, window=3)
    assert sorted(order) == list(range(7))  # every prompt once
    assert order == [1, 0, 2, 5, 3, 4, 6]  # windows {0,1,2} {3,4,5} {6}, each shortest first
    assert batching_order(lengths, window=100) == sorted(range(7), key=lambda i: lengths[i])
    assert batching_order([], window=4) == []


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batched_completions_equal_unbatched_greedy(tmp_path, arch):
    model, tokenizer = tiny_model(arch, 32, 2, init=0.3).eval(), tiny_tokenizer()
    out = write_completions(model, tokenizer, PROMPTS, tmp_path / "c.jsonl", max_new_tokens=9, batch_size=4)
    records = read_completions(out)
    assert sorted(r["prompt"] for r in records) == sorted(PROMPTS)
    assert tokenizer.padding_side == tiny_tokenizer().padding_side  # restored
    for record in records:
        assert record["text"] == record["prompt"] + record["completion"]
        assert record["completion"] == _greedy_alone(model, tokenizer, record["prompt"], 9), record["prompt"]


def test_an_interrupted_file_resumes_without_repeating_prompts(tmp_path):
    model, tokenizer = tiny_model("llama", 32, 2, init=0.3).eval(), tiny_tokenizer()
    path = tmp_path / "c.jsonl"
    write_completions(model, tokenizer, PROMPTS[:3], path, max_new_tokens=4, batch_size=2)
    first = path.read_text().splitlines()
    path.write_text("\n".join(first) + "\n" + first[0][: len(first[0]) // 2])  # a torn line, as after a kill
    write_completions(model, tokenizer, PROMPTS, path, max_new_tokens=4, batch_size=2)
    lines = path.read_text().splitlines()
    assert lines[:3] == first and len(lines) == len(PROMPTS)
    assert sorted(json.loads(line)["prompt"] for line in lines) == sorted(PROMPTS)


def test_a_bad_line_inside_the_file_is_named(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\nnot json\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2 is not a JSON line"):
        read_completions(path)
    path.write_text('{"prompt": "a"}\n')
    with pytest.raises(ValueError, match="has no 'text'"):
        read_completions(path)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"batch_size": 0}, "batch_size"), ({"limit": 0}, "limit"),
    ({"do_sample": True, "temperature": 0.0}, "temperature"), ({"out": "c.json"}, r"\.jsonl"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WriteCompletionsArgs(**{"model": "m", "out": "c.jsonl", **kwargs})


def test_the_cli_writes_and_the_feature_trainer_reads(tmp_path):
    from datasets import Dataset

    folder = tmp_path / "model"
    tiny_model("qwen2", 32, 2, init=0.3).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    Dataset.from_dict({"prompt": PROMPTS}).save_to_disk(tmp_path / "prompts")
    out = tmp_path / "c.jsonl"
    assert main(["write-completions", "--model", str(folder), "--prompts", str(tmp_path / "prompts"), "--limit", "4",
                 "--max_new_tokens", "5", "--batch_size", "3", "--dtype", "float32", "--out", str(out)]) == 0
    records = read_completions(out)
    assert len(records) == 4 and all(r["prompt"] in PROMPTS for r in records)
    texts = load_texts(FeatureDraftArguments(texts=str(out)))
    assert texts == [r["text"] for r in records]
    with pytest.raises(FileNotFoundError, match="write-completions"):
        load_texts(FeatureDraftArguments(texts=str(tmp_path / "missing.jsonl")))
    assert torch.is_grad_enabled()  # generation's no_grad did not leak
