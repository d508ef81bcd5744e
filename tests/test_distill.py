"""Distillation: recipes parse, two TRL DistillationTrainer steps lower the loss (LoRA and full), resume, launch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from tiny import VOCAB, tiny_model
from trl import DistillationConfig, ModelConfig, TrlParser

from pyramid_hf.distill import (
    DistillScriptArguments,
    PromptCollator,
    build_trainer,
    config_class,
    last_checkpoint,
    run,
    save_final,
    trainer_of,
)
from pyramid_hf.testing import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
ALL_RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if "accelerate_configs" not in p.parts)
# a recipe's first line is its launch command; recipes for training/train_feature_draft.py are checked in
# tests/test_feature_train.py
RECIPES = [p for p in ALL_RECIPES if "training/distill.py" in p.read_text().splitlines()[0]]
ACCELERATE_CONFIGS = sorted((ROOT / "recipes" / "accelerate_configs").glob("*.yaml"))


def _parser(trainer="distillation"):
    return TrlParser((DistillScriptArguments, config_class(trainer), ModelConfig))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_parses_with_no_unknown_keys(recipe):
    raw = yaml.safe_load(recipe.read_text())
    # use_cpu: GPU recipes ask for bf16, which TrainingArguments refuses to set up on a machine without a GPU
    trainer = trainer_of(["--config", str(recipe)])
    assert trainer == raw.get("trainer", "distillation")
    script_args, training_args, model_args = _parser(trainer).parse_dict({**raw, "use_cpu": True},
                                                                          allow_extra_keys=False)
    assert script_args.stage in recipe.name and isinstance(training_args, config_class(trainer))
    assert training_args.output_dir
    for key, value in raw.items():  # anything that names a file of this repository must exist
        if isinstance(value, str) and value.startswith(("recipes/", "training/", "model_cards/")):
            assert (ROOT / value).exists(), f"{recipe.name}: {key} names a missing file {value}"


def test_every_recipe_names_its_script_on_its_first_line():
    for recipe in ALL_RECIPES:
        first = recipe.read_text().splitlines()[0]
        assert first.startswith("# accelerate launch") and f"--config {recipe.relative_to(ROOT)}" in first, recipe
        script = next(word for word in first.split() if word.startswith("training/"))
        assert (ROOT / script).is_file(), f"{recipe}: {script} does not exist"
    assert len(RECIPES) >= 9


def test_every_trio_has_both_stages():
    trios = {p.parent.name for p in RECIPES}
    assert {"llama-3", "smollm2", "qwen2.5", "qwen-coder-cpu-distilled"} <= trios
    for trio in trios:
        assert {p.stem for p in RECIPES if p.parent.name == trio} >= {"qualifier_to_target", "draft_to_qualifier"}


@pytest.mark.parametrize("config", ACCELERATE_CONFIGS, ids=lambda p: p.stem)
def test_accelerate_configs_are_valid(config):
    from accelerate.commands.config.config_args import ClusterConfig

    raw = yaml.safe_load(config.read_text())
    known = set(ClusterConfig.__dataclass_fields__)
    assert set(raw) <= known, f"unknown keys {set(raw) - known}"
    assert {p.stem for p in ACCELERATE_CONFIGS} >= {"cpu", "single_gpu", "multi_gpu", "fsdp", "deepspeed_zero3"}


def _prompts(n=8):
    from datasets import Dataset

    tokenizer = tiny_tokenizer()
    g = torch.Generator().manual_seed(0)
    texts = [tokenizer.decode(torch.randint(3, VOCAB, (6,), generator=g)) for _ in range(n)]
    return Dataset.from_dict({"prompt": texts})


def _fixed_batch_kl(student, teacher) -> float:
    ids = torch.randint(3, VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        log_s = student(ids).logits.log_softmax(-1)
        log_t = teacher(ids).logits.log_softmax(-1)
    return float((log_t.exp() * (log_t - log_s)).sum(-1).mean())


def _training_args(out, **kw):
    base = dict(output_dir=str(out), max_steps=2, per_device_train_batch_size=4, max_completion_length=8,
                learning_rate=2e-2, logging_steps=1, save_steps=1, report_to="none", use_cpu=True, bf16=False,
                gradient_checkpointing=False, seed=0, temperature=1.0, beta=0.0)
    return DistillationConfig(**{**base, **kw})


@pytest.mark.parametrize("use_peft", [False, True], ids=["full", "lora"])
def test_two_steps_lower_the_loss_on_a_fixed_batch(tmp_path, use_peft):
    # a peaked teacher, so there is something to learn; forward KL (beta 0) on the student's own completions
    student, teacher = tiny_model("qwen2", seed=1), tiny_model("qwen2", hidden=96, seed=2, init=0.2)
    before = _fixed_batch_kl(student, teacher)
    script_args = DistillScriptArguments(student="tiny-student", teacher="tiny-teacher")
    model_args = ModelConfig(use_peft=use_peft, lora_r=8, lora_alpha=16,
                             lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                             lora_modules_to_save=["lm_head"])
    # seeded (seed 0): two on-policy steps of a LoRA on a random tiny model are noisy across seeds
    lr = 1e-2 if use_peft else 5e-3
    trainer = build_trainer(script_args, _training_args(tmp_path, learning_rate=lr), model_args,
                            student=student, teacher=teacher, tokenizer=tiny_tokenizer(), train_dataset=_prompts())
    trainer.train()
    assert trainer.state.global_step == 2
    final = save_final(trainer, script_args)
    from transformers import AutoModelForCausalLM

    tuned = AutoModelForCausalLM.from_pretrained(final)
    assert not hasattr(tuned, "peft_config")  # a merged, plain model
    assert (final / "adapter").is_dir() == use_peft
    after = _fixed_batch_kl(tuned, teacher)
    assert after < before, f"KL(teacher || student) on a fixed batch went {before:.4f} -> {after:.4f}"


def test_gkd_sequence_kd_trains_on_teacher_written_text(tmp_path):
    """trainer gkd, lmbda 0, seq_kd: every step's text is the teacher's; two steps lower the fixed-batch KL."""
    student, teacher = tiny_model("qwen2", seed=1), tiny_model("qwen2", hidden=96, seed=2, init=0.2)
    before = _fixed_batch_kl(student, teacher)
    args = config_class("gkd")(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                               max_new_tokens=8, max_length=64, learning_rate=5e-3, logging_steps=1, save_steps=2,
                               report_to="none", use_cpu=True, bf16=False, seed=0, temperature=1.0, beta=0.0,
                               lmbda=0.0, seq_kd=True)
    script_args = DistillScriptArguments(student="s", teacher="t", trainer="gkd")
    trainer = build_trainer(script_args, args, None, student=student, teacher=teacher, tokenizer=tiny_tokenizer(),
                            train_dataset=_prompts())
    generated = []
    original = trainer.generate_on_policy_outputs

    def spy(model, inputs, generation_config):
        generated.append(model is trainer.teacher_model)
        return original(model, inputs, generation_config)

    trainer.generate_on_policy_outputs = spy
    trainer.train()
    assert trainer.state.global_step == 2 and generated == [True, True]  # the teacher wrote both steps' text
    final = save_final(trainer, script_args)
    assert (final / "config.json").is_file()
    after = _fixed_batch_kl(trainer.model, teacher)
    assert after < before, f"KL(teacher || student) on a fixed batch went {before:.4f} -> {after:.4f}"
    with pytest.raises(TypeError, match="needs a GKDConfig"):
        build_trainer(script_args, _training_args(tmp_path), None, student=student, teacher=teacher,
                      tokenizer=tiny_tokenizer(), train_dataset=_prompts())


def test_prompt_collator_left_pads_and_trainer_of_reads_flags_then_yaml(tmp_path):
    batch = PromptCollator(tiny_tokenizer())([{"prompt": "a b c"}, {"prompt": "a"}])
    assert batch["prompts"].shape == batch["input_ids"].shape and batch["prompt_attention_mask"][1, 0] == 0
    assert (batch["labels"] == -100).sum() == (batch["attention_mask"] == 0).sum() > 0
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer: gkd\nstage: draft_to_qualifier\n")
    assert trainer_of(["--config", str(recipe)]) == "gkd"
    assert trainer_of(["--config", str(recipe), "--trainer", "distillation"]) == "distillation"
    assert trainer_of(["--trainer=gkd"]) == "gkd" and trainer_of([]) == "distillation"
    with pytest.raises(ValueError, match="trainer must be one of"):
        DistillScriptArguments(student="s", teacher="t", trainer="ppo")


def test_a_derived_student_is_cut_before_training(tmp_path):
    script_args = DistillScriptArguments(student="s", teacher="t", keep_layers="0,2")
    trainer = build_trainer(script_args, _training_args(tmp_path, max_steps=1), None,
                            student=tiny_model("llama", layers=3, seed=3), teacher=tiny_model("llama", seed=4),
                            tokenizer=tiny_tokenizer(), train_dataset=_prompts())
    assert trainer.model.config.num_hidden_layers == 2 and trainer.model.config.pyramid_kept_layers == [0, 2]


def _save_tiny_pair(tmp_path):
    for name, seed, hidden in (("student", 1, 64), ("teacher", 2, 96)):
        tiny_model("qwen2", seed=seed, hidden=hidden).save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    _prompts().save_to_disk(str(tmp_path / "prompts"))


def test_resume_continues_the_step_count(tmp_path):
    _save_tiny_pair(tmp_path)
    script_args = DistillScriptArguments(student=str(tmp_path / "student"), teacher=str(tmp_path / "teacher"),
                                         prompts=str(tmp_path / "prompts"))
    out = tmp_path / "run"
    run(script_args, _training_args(out, max_steps=2))
    assert last_checkpoint(str(out)).endswith("checkpoint-2")
    run(script_args, _training_args(out, max_steps=3))
    assert last_checkpoint(str(out)).endswith("checkpoint-3")
    import json

    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3]


@pytest.mark.slow
def test_accelerate_launch_cpu_smoke(tmp_path):
    _save_tiny_pair(tmp_path)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "recipes/accelerate_configs/cpu.yaml"), str(ROOT / "training/distill.py"),
               "--config", str(ROOT / "recipes/qwen-coder-cpu-distilled/draft_to_qualifier.yaml"),
               "--student", str(tmp_path / "student"), "--teacher", str(tmp_path / "teacher"),
               "--keep_layers", "0,2", "--prompts", str(tmp_path / "prompts"), "--output_dir", str(tmp_path / "out"),
               "--max_steps", "2", "--max_completion_length", "8", "--per_device_train_batch_size", "2",
               "--save_steps", "2", "--report_to", "none", "--use_peft", "false"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out" / "final" / "config.json").is_file()
    assert (tmp_path / "out" / "checkpoint-2").is_dir()
