"""Distill one pyramid stage with TRL's DistillationTrainer or GKDTrainer (see pyramid_hf/distill.py).

    accelerate launch --config_file recipes/accelerate_configs/cpu.yaml training/distill.py --config recipes/qwen-coder-cpu-distilled/qualifier_to_target.yaml

Every field of the recipe YAML is a flag too (flags override the file): `--max_steps 10`, `--use_peft`, ...
"""

import sys

from trl import ModelConfig, TrlParser

from pyramid_hf.distill import DistillScriptArguments, config_class, run, trainer_of


def main() -> None:
    parser = TrlParser((DistillScriptArguments, config_class(trainer_of(sys.argv[1:])), ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    run(script_args, training_args, model_args)


if __name__ == "__main__":
    main()
