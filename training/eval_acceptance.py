"""Acceptance of a student against its teacher on held-out prompts (same as `pyramid-sd eval-acceptance`).

    python training/eval_acceptance.py --preset qwen-coder-cpu --pair qualifier:target --limit 10 --out runs/acceptance

Writes OUT/acceptance.json and OUT/acceptance.md; run it before and after distillation.
"""

import sys

from pyramid_hf.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval-acceptance", *sys.argv[1:]]))
