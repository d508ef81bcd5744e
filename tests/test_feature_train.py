"""Training feature drafts: the recipe parses, the loss falls on a fixed batch, Trainer runs save loadable
folders and resume, `accelerate launch --cpu` runs the script, eval-acceptance walks a feature draft."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_feature_draft import perfect_draft, token_local
from transformers import TrainingArguments
from trl import TrlParser

from pyramid_hf import FeatureDraft
from pyramid_hf.eval_acceptance import EvalAcceptanceArgs, measure
from pyramid_hf.feature_store import FeatureStore
from pyramid_hf.feature_train import (
    FeatureDistillation,
    FeatureDraftArguments,
    build_module,
    kl_to_teacher,
    teacher_distribution,
    train,
)
from pyramid_hf.testing import VOCAB, tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
RECIPES = [p for p in sorted((ROOT / "recipes").rglob("*.yaml"))
           if "training/train_feature_draft.py" in p.read_text().splitlines()[0]]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_parses_with_no_unknown_keys(recipe):
    raw = yaml.safe_load(recipe.read_text())
    script_args, training_args = TrlParser((FeatureDraftArguments, TrainingArguments)).parse_dict(
        raw, allow_extra_keys=False)
    assert script_args.qualifier and training_args.output_dir and training_args.max_steps > 0


def test_recipes_exist():
    assert RECIPES, "no recipe launches training/train_feature_draft.py"


def _texts(folder: Path) -> Path:
    folder.mkdir()
    words = "def return if else for in while import class print self None True False and or not pass range len"
    gen = torch.Generator().manual_seed(0)
    for i in range(6):
        picks = torch.randint(0, 20, (400,), generator=gen).tolist()
        (folder / f"t{i}.py").write_text(" ".join(words.split()[j] for j in picks))
    return folder


@pytest.mark.parametrize("feature_layers", [[-1], [1, -1]])
def test_the_loss_falls_on_a_fixed_batch(feature_layers):
    qualifier = tiny_model("qwen2", 32, 2, init=0.3)
    args = FeatureDraftArguments(vocab_size=None, unroll_steps=2, feature_layers=feature_layers)
    module = build_module(args, qualifier, tiny_tokenizer())
    batch = torch.randint(3, VOCAB, (4, 24), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(25):
        loss = module(batch)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.6 * losses[0], losses
    assert not any(p.requires_grad for p in qualifier.parameters())
    assert set(module.state_dict()) == {f"draft.{k}" for k in module.draft.state_dict()}  # no teacher weights
    assert (module.draft.fuse is not None) == (len(feature_layers) > 1)


@pytest.mark.parametrize("feature_layers", [[-1], [0, -1], [0, 1]])
@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "folder"])
def test_stored_qualifier_states_give_the_same_loss_without_a_second_qualifier_forward(feature_layers, on_disk,
                                                                                      tmp_path):
    qualifier = tiny_model("qwen2", 32, 2, init=0.3)
    args = FeatureDraftArguments(vocab_size=None, cache_features=True, feature_layers=feature_layers)
    module = build_module(args, qualifier, tiny_tokenizer())
    blocks = torch.randint(3, VOCAB, (10, 16), generator=torch.Generator().manual_seed(0))
    module.feature_store = FeatureStore.for_draft(module.draft, qualifier, blocks.tolist(),
                                                  tmp_path if on_disk else None)
    plain = FeatureDistillation(module.draft, qualifier, qualifier.lm_head.weight, 0.1, 2)
    index = torch.tensor([4, 0, 7])
    calls = []
    qualifier.register_forward_hook(lambda *_: calls.append(1))
    first = module(blocks[index], block_index=index)["loss"]
    assert len(calls) == 1 and module.feature_store.stored_blocks() == [0, 4, 7]
    # the final state is stored apart only when the draft does not read it itself
    assert (module.feature_store.final is None) == (-1 in feature_layers)
    second = module(blocks[index[[1, 0]]], block_index=index[[1, 0]])["loss"]  # read blocks, another order
    assert len(calls) == 1
    torch.testing.assert_close(second, plain(blocks[index[[1, 0]]])["loss"], rtol=0, atol=0)
    torch.testing.assert_close(first, plain(blocks[index])["loss"], rtol=0, atol=0)
    module(blocks[[4, 9]], block_index=torch.tensor([4, 9]))  # one new block: a forward
    assert len(calls) == 4 and module.feature_store.stored_blocks() == [0, 4, 7, 9]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_fused_kl_equals_the_log_softmax_form_in_value_and_gradient(dtype):
    gen = torch.Generator().manual_seed(0)
    teacher_logits = 3 * torch.randn(3, 50, 300, generator=gen, dtype=torch.float64)  # 150 rows: chunks of 64 + 22
    draft_logits = (3 * torch.randn(3, 50, 300, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    weights = torch.rand(3, 50, generator=gen, dtype=torch.float64)
    probs, neg_entropy = teacher_distribution(teacher_logits)
    fused = kl_to_teacher(draft_logits, probs, neg_entropy)
    (fused * weights).sum().backward()
    reference_logits = draft_logits.detach().double().requires_grad_()
    teacher_logp = torch.log_softmax(teacher_logits, -1)
    reference = (teacher_logp.exp() * (teacher_logp - torch.log_softmax(reference_logits, -1))).sum(-1)
    (reference * weights).sum().backward()
    assert fused.shape == (3, 50) and draft_logits.grad.dtype == dtype
    torch.testing.assert_close(fused.double(), reference, rtol=1e-5, atol=1e-5)
    tolerance = 1e-6 if dtype == torch.float64 else 4e-3
    torch.testing.assert_close(draft_logits.grad.double(), reference_logits.grad, rtol=0, atol=tolerance)
    assert reference_logits.grad.abs().max() > 0.05  # the gradient compared is not vanishing


def test_bf16_autocast_training_reads_the_bf16_head_as_it_is_and_matches_float32():
    qualifier = tiny_model("qwen2", 32, 2, init=0.3)
    draft = FeatureDraft.from_qualifier(qualifier).float().train()
    batch = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = FeatureDistillation(draft, qualifier.bfloat16(), qualifier.lm_head.weight.float(), 0.1, 2)(batch)
    module = FeatureDistillation(draft, qualifier, qualifier.lm_head.weight, 0.1, 2)
    assert module.head_weight.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = module(batch)["loss"]
    loss.backward()
    trained = [p for name, p in draft.named_parameters() if "embed_tokens" not in name]  # the layer's unused table
    assert all(p.grad is not None and bool(p.grad.isfinite().all()) for p in trained)
    torch.testing.assert_close(loss.float(), reference["loss"].float(), rtol=0.05, atol=0.02)


def test_a_perfect_draft_has_zero_kl():
    qualifier = token_local(tiny_model("llama", 32, 1, init=0.3))
    module = FeatureDistillation(perfect_draft(qualifier), qualifier, qualifier.lm_head.weight, 0.1, 2)
    module(torch.randint(3, VOCAB, (2, 16)))
    assert max(module.last_parts.values()) < 1e-6, module.last_parts


def test_trainer_saves_loadable_folders_and_resumes(tmp_path, monkeypatch):
    qualifier, tokenizer = tiny_model("llama", 32, 2), tiny_tokenizer()
    seen = []
    read = FeatureDistillation._qualifier_states
    monkeypatch.setattr(FeatureDistillation, "_qualifier_states",
                        lambda self, ids, mask, index=None: seen.append(index) or read(self, ids, mask, index))
    args = FeatureDraftArguments(texts=str(_texts(tmp_path / "texts")), block_size=32, vocab_size=None,
                                 cache_features=True)
    training_args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=2,
                                      save_steps=2, report_to="none", use_cpu=True, learning_rate=1e-3)
    final = train(args, training_args, qualifier=qualifier, tokenizer=tokenizer)
    draft = FeatureDraft.load(final)
    assert draft.meta["steps"] == 2 and (tmp_path / "run" / "checkpoint-2" / "draft" / "feature_draft.json").is_file()
    training_args.max_steps = 3
    final = train(args, training_args, qualifier=qualifier, tokenizer=tokenizer)
    assert FeatureDraft.load(final).meta["steps"] == 3  # resumed at step 2, not restarted
    assert len(seen) == 3 and all(index is not None and len(index) == 2 for index in seen)  # Trainer passes indices
    args.init_from, training_args.output_dir = str(final), str(tmp_path / "continued")
    continued = FeatureDraft.load(train(args, training_args, qualifier=qualifier, tokenizer=tokenizer))
    assert continued.meta["steps"] == 6 and continued.meta["steps_before"] == 3  # --init_from counts earlier runs


def test_accelerate_launch_cpu_smoke(tmp_path):
    qualifier_dir = tmp_path / "qualifier"
    tiny_model("qwen2", 32, 2).save_pretrained(qualifier_dir)
    tiny_tokenizer().save_pretrained(qualifier_dir)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "recipes/accelerate_configs/cpu.yaml"), str(ROOT / "training/train_feature_draft.py"),
           "--config", str(ROOT / "recipes/qwen-coder-cpu-distilled/feature_draft.yaml"),
           "--qualifier", str(qualifier_dir), "--qualifier_dtype", "float32", "--texts", str(_texts(tmp_path / "t")),
           "--block_size", "32", "--max_steps", "1", "--output_dir", str(out), "--save_steps", "10"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "final" / "feature_draft.safetensors").is_file()


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_eval_acceptance_walks_a_feature_draft(tmp_path, noise):
    qualifier = token_local(tiny_model("llama", 32, 1, init=0.3))
    draft = perfect_draft(qualifier)
    with torch.no_grad():
        draft.fc.weight[:, :32].normal_(0, noise / 32**0.5 if noise else 0.0)
    prompts = [torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    args = EvalAcceptanceArgs(out=str(tmp_path), preset=None, student="s", teacher="t", limit=3, draft_tokens=4,
                              max_new_tokens=30, latency_repeats=1, progress=False)
    result = measure(draft, qualifier, prompts, args)
    if noise == 0.0:  # the draft reproduces the qualifier: every reached position is kept, 5 tokens per call
        assert result["acceptance_exact_greedy"] == 1.0 and result["mean_tv"] < 1e-5
        assert result["mean_accepted_tokens"] > 4.5
    else:
        assert result["acceptance_exact_greedy"] < 1.0 and result["mean_accepted_tokens"] < 4.5
    assert result["latency_ms"]["student_1"] > 0 and result["break_even_accepted_tokens"] > 0


def test_a_perfect_feature_draft_is_kept_along_another_models_path(tmp_path):
    qualifier = token_local(tiny_model("llama", 32, 1, init=0.3))
    prompts = [torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    args = EvalAcceptanceArgs(out=str(tmp_path), preset=None, student="s", teacher="t", limit=3, draft_tokens=4,
                              max_new_tokens=20, latency_repeats=0, progress=False)
    result = measure(perfect_draft(qualifier), qualifier, prompts, args,
                     path_model=tiny_model("llama", 32, 2, seed=5, init=0.3))
    assert result["acceptance_exact_greedy"] == 1.0 and result["mean_tv"] < 1e-5


def test_continuing_a_draft_with_other_feature_layers_is_refused(tmp_path):
    qualifier, tokenizer = tiny_model("llama", 32, 2), tiny_tokenizer()
    folder = FeatureDraft.from_qualifier(qualifier, feature_layers=(1, -1)).save(tmp_path / "d")
    continued = build_module(FeatureDraftArguments(vocab_size=None, init_from=str(folder)), qualifier, tokenizer)
    assert continued.draft.feature_layers == (1, -1)  # the default keeps the draft's own
    with pytest.raises(ValueError, match=r"feature_layers \[0, -1\] differ.*\[1, -1\]"):
        build_module(FeatureDraftArguments(vocab_size=None, init_from=str(folder), feature_layers=[0, -1]),
                     qualifier, tokenizer)
