"""Every command and path the README names exists, and its usage example runs as written."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_starts_with_the_two_commands():
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    assert "pyramid-sd generate --preset qwen-coder-cpu" in blocks[0] and "pip install torch==2.13.0" in blocks[0]
    assert "python -m pytest" in blocks[1]
    assert "python -m pytest" in (ROOT / ".ci" / "run").read_text()


def test_paths_named_in_readme_exist():
    paths = set(re.findall(r"`((?:pyramid_hf|tests|recipes|training|model_cards|\.ci)/[\w./-]*)`", README))
    assert paths, "the README names no paths?"
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing


def test_usage_example_runs_as_written():
    code = re.search(r"```python\n(.*?)```", README, flags=re.S).group(1)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(ROOT / "tests"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "128 tokens" in result.stdout


def test_cli_demo_reproduces_target():
    result = subprocess.run([sys.executable, "-m", "pyramid_hf.cli", "demo", "--max-new-tokens", "12"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "identical_to_target_greedy=True" in result.stdout


PATH_PATTERN = r"((?:pyramid_hf|tests|recipes|training|model_cards|custom_generate|\.ci)/[\w./-]*\w)"


def test_paths_in_other_docs_and_script_docstrings_exist():
    import ast

    texts = {"recipes/README.md": (ROOT / "recipes" / "README.md").read_text()}
    for script in [*(ROOT / "training").glob("*.py"), ROOT / "pyramid_hf" / "cli.py", ROOT / "pyramid_hf" / "hub.py",
                   ROOT / "custom_generate" / "generate.py"]:
        texts[str(script.relative_to(ROOT))] = ast.get_docstring(ast.parse(script.read_text())) or ""
    missing = {}
    for name, text in texts.items():
        paths = {p for p in re.findall(PATH_PATTERN, text) if not p.startswith(("runs/",))}
        gone = [p for p in paths if not (ROOT / p).exists()]
        if gone:
            missing[name] = gone
    assert not missing, missing
    assert re.findall(PATH_PATTERN, texts["training/distill.py"]), "the distill docstring names no recipe?"
