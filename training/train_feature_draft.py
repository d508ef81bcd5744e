"""Train a feature-level (EAGLE-style) draft against its qualifier (see pyramid_hf/feature_train.py).

    accelerate launch --config_file recipes/accelerate_configs/cpu.yaml training/train_feature_draft.py --config recipes/qwen-coder-cpu-distilled/feature_draft.yaml

Every field of the recipe YAML is a flag too (flags override the file): `--max_steps 10`, `--unroll_steps 3`, ...
The result, OUTPUT_DIR/final, is a feature-draft folder: pass it as `--draft` to `pyramid-sd generate/bench` or as
`--student` to `pyramid-sd eval-acceptance`.
"""

from transformers import TrainingArguments
from trl import TrlParser

from pyramid_hf.feature_train import FeatureDraftArguments, train


def main() -> None:
    parser = TrlParser((FeatureDraftArguments, TrainingArguments))
    script_args, training_args = parser.parse_args_and_config()
    train(script_args, training_args)


if __name__ == "__main__":
    main()
