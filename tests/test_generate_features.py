"""generate() features with a pyramid behave as in plain generate(): stop strings, streamers, padded masks."""

import pytest
import torch
from tiny import VOCAB, tiny_trio
from transformers.generation.streamers import BaseStreamer

from pyramid_hf import PyramidAssistant
from pyramid_hf.testing import PAD_ID, tiny_tokenizer


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def _prompt(seed=0, n=7):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def test_streamer_gets_the_prompt_then_every_token_once():
    target, qualifier, draft = tiny_trio("qwen2", seed=3)
    ids = _prompt(3)
    streamer = Collect()
    out = target.generate(ids, assistant_model=PyramidAssistant(qualifier, draft), do_sample=False,
                          max_new_tokens=19, streamer=streamer)
    assert streamer.chunks[0] == ids[0].tolist() and streamer.ended
    assert sum(streamer.chunks[1:], []) == out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("draft_kind", ["model", "prompt_lookup"])
def test_left_padded_prompt_matches_plain_generate(draft_kind):
    target, qualifier, draft = tiny_trio("llama", seed=4)
    ids = torch.cat([torch.full((1, 3), PAD_ID), _prompt(4)], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)], dim=1)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=21)
    assistant = PyramidAssistant(qualifier, draft if draft_kind == "model" else "prompt_lookup")
    got = target.generate(ids, attention_mask=mask, assistant_model=assistant, do_sample=False, max_new_tokens=21)
    assert torch.equal(got, expected)


def test_assistant_tokenizer_is_refused():
    target, qualifier, draft = tiny_trio("llama")
    tokenizer = tiny_tokenizer()
    with pytest.raises(ValueError, match="assistant_tokenizer"):
        target.generate(_prompt(), assistant_model=PyramidAssistant(qualifier, draft), max_new_tokens=3,
                        tokenizer=tokenizer, assistant_tokenizer=tokenizer)
