"""Greedy continuations kept in a JSONL file, so that repeated ``eval-acceptance`` runs on the same prompts (the
checkpoints of one training run) generate each teacher path once.

A record holds what wrote the path (model source, dtype, quantization, continuation length), the prompt's ids and
the prompt with its continuation. A record is reused only when all of these match; anything else is generated and
appended. The writer is named by its source (Hub id or folder): if the model behind a name changes, start a new file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch


class GreedyPaths:
    """The continuations of ``file`` written by ``writer`` (a JSON-able dict), and where to append new ones."""

    def __init__(self, file: str | Path, writer: dict):
        self.file = Path(file).expanduser()
        self.writer = json.loads(json.dumps(writer))  # as it reads back from the file
        self.paths: dict[tuple[int, ...], list[int]] = {}
        self.reused = self.written = 0
        if self.file.is_file():
            for number, line in enumerate(self.file.read_text().splitlines(), 1):
                if line.strip():
                    self._read(line, number)

    def _read(self, line: str, number: int) -> None:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{self.file}:{number} is not JSON ({error}); delete the file to regenerate it") from None
        if not isinstance(record, dict) or not {"writer", "prompt_ids", "ids"} <= record.keys():
            raise ValueError(f"{self.file}:{number} is not a greedy-path record (keys writer, prompt_ids, ids)")
        prompt, ids = record["prompt_ids"], record["ids"]
        if ids[: len(prompt)] != prompt:
            raise ValueError(f"{self.file}:{number}: the path does not start with its prompt")
        if record["writer"] == self.writer:
            self.paths[tuple(prompt)] = ids

    def continuation(self, prompt_ids: torch.Tensor, generate: Callable[[], torch.Tensor]) -> torch.Tensor:
        """(1, L) prompt and its continuation: from the file where it holds one, else ``generate()``'s, appended."""
        key = tuple(int(i) for i in prompt_ids[0].tolist())
        if key in self.paths:
            self.reused += 1
            return torch.tensor([self.paths[key]], dtype=torch.long)
        full = generate()
        self.paths[key] = [int(i) for i in full[0].tolist()]
        self.file.parent.mkdir(parents=True, exist_ok=True)
        with self.file.open("a") as handle:
            handle.write(json.dumps({"writer": self.writer, "prompt_ids": list(key), "ids": self.paths[key]}) + "\n")
        self.written += 1
        return full
