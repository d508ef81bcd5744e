"""Distillation of one pyramid stage with TRL: the on-policy `DistillationTrainer` or GKD (generalized JSD, `beta`).

``trainer: distillation`` (default): the student writes completions for the training prompts and learns the
teacher's next-token distributions on them. ``trainer: gkd``: TRL's `GKDTrainer`, where ``lmbda`` is the share of
steps on student-written completions and, with ``seq_kd``, the teacher writes the others (sequence-level KD: the
student learns on the text it will have to predict at inference, the teacher's own); with neither, the prompts
themselves are the text. ``qualifier_to_target`` pulls the qualifier toward the target, ``draft_to_qualifier``
the draft toward the (tuned) qualifier. Student and teacher come from the model-source layer (Hub id, local folder, GGUF file);
a derived draft is cut from its base model first (``keep_layers``). LoRA via PEFT (``use_peft``) or full
fine-tuning; LoRA students are merged and saved as plain safetensors models in ``OUTPUT_DIR/final``.
Runs resume from the last checkpoint in ``output_dir``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("pyramid_hf")


TRAINERS = ("distillation", "gkd")


def config_class(trainer: str):
    """The TRL config dataclass of ``trainer`` (what TrlParser parses the recipe's training keys into)."""
    if trainer == "gkd":
        from trl.experimental.gkd import GKDConfig

        return GKDConfig
    if trainer == "distillation":
        from trl import DistillationConfig

        return DistillationConfig
    raise ValueError(f"trainer must be one of {sorted(TRAINERS)}, got {trainer!r}")


def trainer_of(argv: list[str]) -> str:
    """Which trainer a command line asks for: ``--trainer X`` wins over the ``--config`` YAML's ``trainer`` key."""
    import yaml

    for i, arg in enumerate(argv):
        if arg == "--trainer" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--trainer="):
            return arg.split("=", 1)[1]
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else (
            arg.split("=", 1)[1] if arg.startswith("--config=") else None)
        if path:
            raw = yaml.safe_load(Path(path).read_text()) or {}
            return raw.get("trainer", "distillation")
    return "distillation"


class PromptCollator:
    """Batches text prompts for `GKDTrainer`: left-padded ``prompts`` to generate from, and the same ids as
    ``input_ids``/``labels`` (the text trained on when a step generates nothing)."""

    def __init__(self, tokenizer, max_length: int = 512):
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, examples: list[dict]) -> dict:
        encoded = self.tokenizer([e["prompt"] for e in examples], padding=True, padding_side="left",
                                 truncation=True, max_length=self.max_length, return_tensors="pt")
        labels = encoded.input_ids.masked_fill(encoded.attention_mask == 0, -100)
        return {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask, "labels": labels,
                "prompts": encoded.input_ids, "prompt_attention_mask": encoded.attention_mask}


@dataclass
class DistillScriptArguments:
    student: str = field(metadata={"help": "student model: Hub id, local folder or GGUF file"})
    teacher: str = field(metadata={"help": "teacher model: Hub id, local folder or GGUF file"})
    trainer: str = field(default="distillation", metadata={
        "help": "distillation (TRL DistillationTrainer, on-policy) or gkd (TRL GKDTrainer: lmbda, seq_kd)"})
    stage: str = field(default="qualifier_to_target",
                       metadata={"help": "which pyramid stage this trains: qualifier_to_target or draft_to_qualifier"})
    prompts: str = field(default="stdlib-code",
                         metadata={"help": "training prompts: 'stdlib-code' or 'site-packages-code' (offline "
                                           "builders) or a Hub dataset name"})
    prompt_column: str = field(default="prompt", metadata={"help": "text column of a Hub prompt dataset"})
    prompt_split: str = field(default="train", metadata={"help": "split of a Hub prompt dataset"})
    prompt_limit: int | None = field(default=None, metadata={"help": "use at most this many prompts"})
    keep_layers: str | None = field(default=None, metadata={
        "help": "derive the student by keeping these decoder layers of it (comma-separated indices, any subset)"})
    model_dtype: str = field(default="float32", metadata={"help": "dtype the student and teacher are loaded in"})
    merge_lora: bool = field(default=True, metadata={"help": "merge a LoRA student into its base before saving"})

    def __post_init__(self):
        if self.trainer not in TRAINERS:
            raise ValueError(f"trainer must be one of {sorted(TRAINERS)}, got {self.trainer!r}")
        if self.stage not in ("qualifier_to_target", "draft_to_qualifier"):
            raise ValueError(f"stage must be qualifier_to_target or draft_to_qualifier, got {self.stage!r}")
        if self.keep_layers is not None:
            try:
                self.kept_layers = [int(i) for i in str(self.keep_layers).split(",") if i.strip()]
            except ValueError:
                raise ValueError(f"keep_layers must be comma-separated layer indices, got {self.keep_layers!r}") from None
        else:
            self.kept_layers = None


def last_checkpoint(output_dir: str) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    folder = Path(output_dir)
    return get_last_checkpoint(str(folder)) if folder.is_dir() else None


def build_trainer(script_args: DistillScriptArguments, training_args, model_args=None, *, student=None,
                  teacher=None, tokenizer=None, train_dataset=None):
    """The stage's trainer (`DistillationTrainer` or `GKDTrainer`); models and data may be passed in (tests)."""
    from trl import DistillationTrainer, get_peft_config

    from .derive import cut_layers
    from .models import load_model
    from .prompts import load_prompts
    from .trio import _check_same_tokenizer

    if student is None:
        loaded = load_model(script_args.student, dtype=script_args.model_dtype, reduced_vocab=False)
        student, tokenizer = loaded.model, tokenizer or loaded.tokenizer
        logger.info("student: %s", loaded.origin)
    if teacher is None:
        loaded_teacher = load_model(script_args.teacher, dtype=script_args.model_dtype, reduced_vocab=False)
        teacher = loaded_teacher.model
        _check_same_tokenizer(loaded_teacher.tokenizer, {"student": tokenizer})
        logger.info("teacher: %s", loaded_teacher.origin)
    if tokenizer is None:
        raise ValueError(f"no tokenizer found with the student {script_args.student}")
    if script_args.kept_layers is not None and getattr(student.config, "pyramid_kept_layers", None) is None:
        student = cut_layers(student, script_args.kept_layers)
        logger.info("derived student: kept decoder layers %s", student.config.pyramid_kept_layers)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if train_dataset is None:
        train_dataset = load_prompts(script_args.prompts, limit=script_args.prompt_limit,
                                     split=script_args.prompt_split, column=script_args.prompt_column,
                                     seed=training_args.seed)
    peft_config = get_peft_config(model_args) if model_args is not None else None
    expected = config_class(script_args.trainer)
    if not isinstance(training_args, expected):
        raise TypeError(f"trainer {script_args.trainer!r} needs a {expected.__name__}, got "
                        f"{type(training_args).__name__}")
    if script_args.trainer == "gkd":
        from trl.experimental.gkd import GKDTrainer

        return GKDTrainer(model=student, teacher_model=teacher, args=training_args, train_dataset=train_dataset,
                          processing_class=tokenizer, peft_config=peft_config,
                          data_collator=PromptCollator(tokenizer, training_args.max_length or 512))
    return DistillationTrainer(model=student, teacher_model=teacher, args=training_args, train_dataset=train_dataset,
                               processing_class=tokenizer, peft_config=peft_config)


def save_final(trainer, script_args: DistillScriptArguments) -> Path:
    """OUTPUT_DIR/final: a plain safetensors model (LoRA merged when asked) plus its tokenizer."""
    final = Path(trainer.args.output_dir) / "final"
    model = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(model, "peft_config"):
        model.save_pretrained(final / "adapter")
        if script_args.merge_lora:
            model = model.merge_and_unload()
    if trainer.accelerator.is_main_process:
        model.save_pretrained(final)
        trainer.processing_class.save_pretrained(final)
    return final


def run(script_args: DistillScriptArguments, training_args, model_args=None) -> Path:
    trainer = build_trainer(script_args, training_args, model_args)
    resume = training_args.resume_from_checkpoint or last_checkpoint(training_args.output_dir)
    if resume:
        logger.info("resuming from %s", resume)
    trainer.train(resume_from_checkpoint=resume)
    final = save_final(trainer, script_args)
    logger.info("saved the distilled %s to %s", script_args.stage.split("_to_")[0], final)
    return final
