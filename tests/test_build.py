"""`pyramid-sd models build`: every plan's commands parse and chain into the preset's draft folder; the runner skips
finished steps, records wall times and stops at a failing step with its name."""

import json
import sys
from pathlib import Path

import pytest
import yaml
from transformers import TrainingArguments
from trl import ModelConfig, TrlParser

from pyramid_hf.cli import main
from pyramid_hf.distill import DistillScriptArguments, config_class, trainer_of
from pyramid_hf.feature_train import FeatureDraftArguments
from pyramid_hf.models import PRESETS, cache_root
from pyramid_hf.models.build import PLANS, BuildStep, command_line, get_plan, run_plan

ROOT = Path(__file__).resolve().parents[1]


def _flags(argv) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def _help_of(command: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main([*command, "--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


def _training_parse(script: str, args: list[str]):
    if script.endswith("train_feature_draft.py"):
        return TrlParser((FeatureDraftArguments, TrainingArguments)).parse_args_and_config(args=args)
    assert script.endswith("distill.py"), script
    trainer = trainer_of(args)
    return TrlParser((DistillScriptArguments, config_class(trainer), ModelConfig)).parse_args_and_config(args=args)


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_commands_parse_and_name_existing_files(name, capsys):
    for step in get_plan(name):
        argv = list(step.argv)
        for arg in argv:
            if arg.startswith(("recipes/", "training/")):
                assert (ROOT / arg).exists(), f"{name}: {step.name} names a missing file {arg}"
        if argv[0] == "pyramid-sd":
            words = [a for a in argv[1:3] if not a.startswith("-")]
            command = words[:2] if words[0] == "models" else words[:1]
            help_text = _help_of(command, capsys)
            for flag in _flags(argv[1 + len(command):]):
                assert flag in help_text, f"{name}: `{' '.join(command)}` has no flag {flag}"
        else:
            assert argv[:2] == ["accelerate", "launch"], step.argv
            assert "--config_file" in argv and (ROOT / argv[argv.index("--config_file") + 1]).is_file()
            script = next(a for a in argv if a.startswith("training/"))
            args = argv[argv.index(script) + 1:]
            args[args.index("--config") + 1] = str(ROOT / args[args.index("--config") + 1])
            parsed = _training_parse(script, [*args, "--use_cpu", "true"])
            output_dir = Path(parsed[1].output_dir)
            assert step.output is not None and Path(step.output).parent.parent == output_dir, \
                f"{name}: {step.name} checks {step.output} but trains into {output_dir}"


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_chains_into_the_preset_draft_folder(name):
    steps = get_plan(name)
    publish = steps[-1]
    assert publish.argv[:2] == ("pyramid-sd", "publish")
    out = publish.argv[publish.argv.index("--output-dir") + 1]
    assert out == "{cache}/" + PRESETS[name].draft.local_dir
    outputs = [str(Path(s.output).parent) for s in steps if s.output]
    model = publish.argv[publish.argv.index("--model") + 1]
    results = publish.argv[publish.argv.index("--results") + 1]
    assert model in outputs and str(Path(results).parent) in outputs
    evaluate = next(s for s in steps if "eval-acceptance" in s.argv)
    assert evaluate.argv[evaluate.argv.index("--student") + 1] == model
    for step in steps:  # what a recipe reads (init_from, texts) is written by an earlier step
        if "--config" in step.argv:
            raw = yaml.safe_load((ROOT / step.argv[step.argv.index("--config") + 1]).read_text())
            earlier = steps[: steps.index(step)]
            for key in ("init_from", "texts"):
                value = raw.get(key)
                if isinstance(value, str) and value.startswith("runs/"):
                    assert any(value in (str(Path(s.output or "").parent), *s.argv) for s in earlier), \
                        f"{name}: {step.name} reads {key}={value}, which no earlier step writes"


def test_command_line_runs_this_python_and_fills_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PYRAMID_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    step = BuildStep("x", ("pyramid-sd", "publish", "--output-dir", "{cache}/a/draft", "--recipe", "recipes/r.yaml"))
    argv = command_line(step)
    assert argv[:3] == [sys.executable, "-m", "pyramid_hf.cli"]
    assert argv[argv.index("--output-dir") + 1] == str(cache_root() / "a/draft")
    assert argv[-1] == str(ROOT / "recipes/r.yaml")  # not under the working directory: taken from the repository
    launch = command_line(BuildStep("y", ("accelerate", "launch", "--config_file", "c.yaml", "t.py")))
    assert launch[:3] == [sys.executable, "-m", "accelerate.commands.launch"] and launch[3:] == ["--config_file",
                                                                                              "c.yaml", "t.py"]


def _writer(path: Path, text: str = "ok") -> tuple[str, ...]:
    return (sys.executable, "-c", f"import pathlib; pathlib.Path({str(path)!r}).write_text({text!r})")


def test_run_plan_skips_finished_steps_records_times_and_resumes(tmp_path):
    first, second, log = tmp_path / "first", tmp_path / "second", tmp_path / "log"
    first.write_text("from an earlier run")
    steps = [
        BuildStep("first", _writer(first, "rewritten"), str(first)),
        BuildStep("always", (sys.executable, "-c", f"open({str(log)!r}, 'a').write('ran ')")),
        BuildStep("second", _writer(second), str(second)),
    ]
    record = tmp_path / "build.json"
    records = run_plan("tiny", steps, record=record)
    assert first.read_text() == "from an earlier run"  # skipped: its output existed
    assert second.read_text() == "ok" and log.read_text() == "ran "
    assert [r["status"] for r in records] == ["skipped", "ok", "ok"]
    saved = json.loads(record.read_text())
    assert saved["preset"] == "tiny" and all(r["seconds"] >= 0 for r in saved["steps"] if r["status"] == "ok")
    run_plan("tiny", steps)  # everything with an output is done now; the resumable step runs again
    assert log.read_text() == "ran ran "
    run_plan("tiny", steps, force=True)
    assert first.read_text() == "rewritten"


def test_run_plan_dry_run_runs_nothing(tmp_path, capsys):
    target = tmp_path / "never"
    run_plan("tiny", [BuildStep("write", _writer(target), str(target))], dry_run=True)
    assert not target.exists() and "[1/1] write" in capsys.readouterr().out


def test_run_plan_stops_at_a_failing_step_with_its_name(tmp_path):
    after = tmp_path / "after"
    steps = [BuildStep("breaks", (sys.executable, "-c", "raise SystemExit(3)")),
             BuildStep("after", _writer(after), str(after))]
    with pytest.raises(RuntimeError, match=r"step 1 \(breaks\).*exited with 3.*again to resume"):
        run_plan("tiny", steps, record=tmp_path / "b.json")
    assert not after.exists()
    assert json.loads((tmp_path / "b.json").read_text())["steps"][0]["status"] == "exit 3"
    silent = [BuildStep("forgets its output", (sys.executable, "-c", "pass"), str(tmp_path / "missing"))]
    with pytest.raises(RuntimeError, match="did not write"):
        run_plan("tiny", silent)


def test_unknown_plan_is_named(capsys):
    assert main(["models", "build", "qwen-coder-cpu"]) == 2
    assert "no build plan for 'qwen-coder-cpu'" in capsys.readouterr().err
    for preset in PRESETS.values():  # every preset whose draft is a built folder has a plan, and its hint names it
        if getattr(preset.draft, "local_dir", None):
            assert preset.name in PLANS and f"pyramid-sd models build {preset.name}" in preset.draft.build_hint
