"""Every command and path the README names exists, and its usage example runs as written."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_starts_with_the_two_commands():
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    assert "pyramid-sd demo" in blocks[0] and "pip install torch==2.13.0" in blocks[0]
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
