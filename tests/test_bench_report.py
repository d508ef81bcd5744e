"""The bench end to end on a tiny in-process trio (no downloads): results.json / results.md / speed_quality.png."""

import copy
import json

import pytest
from tiny import tiny_tokenizer, tiny_trio

from pyramid_hf.bench.humaneval import load_tasks
from pyramid_hf.bench.main import BenchArgs, bench_trio
from pyramid_hf.bench.methods import ALL_METHODS
from pyramid_hf.bench.report import fill_relative_speedups, load_results, make_records, write_results
from pyramid_hf.trio import Trio

ISSUE_KEYS = {"method", "knobs", "tokens_per_s", "speedup_vs_ar", "speedup_vs_best_sd", "analytic_speedup",
              "acceptance", "mean_tokens_per_target_call", "overhead_share", "identical_to_ar", "pass_at_1"}


@pytest.fixture(scope="module")
def bench_output(tmp_path_factory):
    target, _, draft = tiny_trio("llama", seed=3, init=0.5)
    qualifier = copy.deepcopy(target)  # a qualifier that agrees with the target: PSD must show > 1 token per call
    trio = Trio(target, qualifier, draft, tiny_tokenizer(), origins={"target": "tiny-64", "qualifier": "tiny-32",
                                                                     "draft": "tiny-16"})
    out = tmp_path_factory.mktemp("bench")
    args = BenchArgs(out=str(out), preset=None, limit=3, tune_limit=1, max_new_tokens=10, sd_tokens="2,3",
                     lookup_tokens="2", psd_grid="2:4", tau_grid="0.2:0.1,0.4:0.3", check_timeout_s=5, progress=False,
                     stop_strings=False)
    summaries, config = bench_trio(trio, args, {"draft_tokens": 2, "qualifier_tokens": 4},
                                   load_tasks("test", 3), load_tasks("dev", 1))
    records = make_records(summaries)
    fill_relative_speedups(records)
    return write_results(out, config, records), records


def test_json_has_every_method_with_the_issue_keys(bench_output):
    paths, records = bench_output
    payload = json.loads(paths["json"].read_text())
    assert set(payload) == {"config", "methods"}
    assert payload["config"]["reported_on"] == [82, 83, 84] and payload["config"]["tuned_on"] == [0]
    methods = [m["method"] for m in payload["methods"]]
    assert set(methods) == set(ALL_METHODS)
    assert methods.count("psd_f") == 2  # one record per tau pair
    for record in payload["methods"]:
        assert ISSUE_KEYS <= set(record), ISSUE_KEYS - set(record)
        assert record["n_prompts"] == 3 and record["pass_at_1"] is not None
        assert 0.0 <= record["overhead_share"] < 1.0
    ar = next(m for m in payload["methods"] if m["method"] == "ar")
    assert ar["speedup_vs_ar"] == pytest.approx(1.0) and ar["mean_tokens_per_target_call"] == pytest.approx(1.0)
    best_sd = max(m["tokens_per_s"] for m in payload["methods"] if m["method"].startswith("sd_"))
    for record in payload["methods"]:
        assert record["speedup_vs_best_sd"] == pytest.approx(record["tokens_per_s"] / best_sd)
        if record["method"] in ("psd", "psd_a", "sd_qualifier", "sd_draft", "sd_lookup"):
            assert record["identical_to_ar"] == 1.0  # fp32 tiny models: lossless means identical
    psd = next(m for m in payload["methods"] if m["method"] == "psd")
    assert 0.0 <= psd["acceptance"]["qualifier->target"] <= 1.0
    assert psd["mean_tokens_per_target_call"] > 1.0


def test_markdown_table_has_a_row_per_record(bench_output):
    paths, records = bench_output
    text = paths["markdown"].read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert len(rows) == len(records)
    assert all(row.count("|") == 16 for row in rows)
    assert all(r.decode_tokens_per_s and r.decode_tokens_per_s >= r.tokens_per_s for r in records)
    assert "Best two-model SD: sd_" in text


def test_plot_is_a_png(bench_output):
    paths, _ = bench_output
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["plot"].stat().st_size > 5000


def test_results_round_trip_and_bad_files_fail_clearly(bench_output, tmp_path):
    paths, records = bench_output
    config, loaded = load_results(paths["json"])
    assert [r.label for r in loaded] == [r.label for r in records]
    assert loaded[0].tokens_per_s == records[0].tokens_per_s
    with pytest.raises(FileNotFoundError, match="not found"):
        load_results(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_results(bad)
    bad.write_text(json.dumps({"methods": []}))
    with pytest.raises(ValueError, match="not a bench results file"):
        load_results(bad)
    payload = json.loads(paths["json"].read_text())
    del payload["methods"][1]["pass_at_1"]
    bad.write_text(json.dumps(payload))
    with pytest.raises(ValueError, match=r"methods\[1\] lacks \['pass_at_1'\]"):
        load_results(bad)


def test_report_needs_ar():
    records = make_records([])
    with pytest.raises(ValueError, match="needs an ar record"):
        fill_relative_speedups(records)


def test_plot_labels_are_short_and_keep_every_knob(bench_output):
    from pyramid_hf.bench.report import short_label

    paths, _ = bench_output
    _, records = load_results(paths["json"])
    psd_f = next(r for r in records if r.method == "psd_f")
    label = short_label(psd_f)
    assert label.startswith("psd_f lD=") and " lQ=" in label and " tT=" in label and " tQ=" in label
    assert label.index("lD=") < label.index("lQ=") < label.index("tT=") < label.index("tQ=")
    assert short_label(next(r for r in records if r.method == "ar")) == "ar"
