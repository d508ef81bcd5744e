"""Distillation of one pyramid stage with TRL's on-policy `DistillationTrainer` (generalized JSD, `beta`).

The student writes completions for the training prompts and learns the teacher's next-token distributions on
them: ``qualifier_to_target`` pulls the qualifier toward the target, ``draft_to_qualifier`` the draft toward
the (tuned) qualifier. Student and teacher come from the model-source layer (Hub id, local folder, GGUF file);
a derived draft is cut from its base model first (``keep_layers``). LoRA via PEFT (``use_peft``) or full
fine-tuning; LoRA students are merged and saved as plain safetensors models in ``OUTPUT_DIR/final``.
Runs resume from the last checkpoint in ``output_dir``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("pyramid_hf")


@dataclass
class DistillScriptArguments:
    student: str = field(metadata={"help": "student model: Hub id, local folder or GGUF file"})
    teacher: str = field(metadata={"help": "teacher model: Hub id, local folder or GGUF file"})
    stage: str = field(default="qualifier_to_target",
                       metadata={"help": "which pyramid stage this trains: qualifier_to_target or draft_to_qualifier"})
    prompts: str = field(default="stdlib-code",
                         metadata={"help": "training prompts: 'stdlib-code' (offline builder) or a Hub dataset name"})
    prompt_column: str = field(default="prompt", metadata={"help": "text column of a Hub prompt dataset"})
    prompt_split: str = field(default="train", metadata={"help": "split of a Hub prompt dataset"})
    prompt_limit: int | None = field(default=None, metadata={"help": "use at most this many prompts"})
    keep_layers: str | None = field(default=None, metadata={
        "help": "derive the student by keeping these decoder layers of it (comma-separated indices, any subset)"})
    model_dtype: str = field(default="float32", metadata={"help": "dtype the student and teacher are loaded in"})
    merge_lora: bool = field(default=True, metadata={"help": "merge a LoRA student into its base before saving"})

    def __post_init__(self):
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
    """A `DistillationTrainer` for one stage; models and data may be passed in (tests) or are loaded."""
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
