"""Counts and times every forward pass of the benchmarked models, whoever calls them.

Forward hooks see Transformers' own assisted decoding, prompt lookup and the pyramid alike, so every
method's per-model cost is measured the same way.
"""

from __future__ import annotations

import time


class ForwardMeter:
    """``with ForwardMeter({"target": t, "qualifier": q}) as meter: ...; meter.calls, meter.seconds``."""

    def __init__(self, models: dict):
        seen = {}
        for role, model in models.items():
            if id(model) in seen:
                raise ValueError(f"the {role} and the {seen[id(model)]} are the same model object; "
                                 "a benchmark needs one object per role")
            seen[id(model)] = role
        self.models = dict(models)
        self.calls = dict.fromkeys(self.models, 0)
        self.seconds = dict.fromkeys(self.models, 0.0)
        self.first_seconds = dict.fromkeys(self.models, 0.0)  # each model's first forward: the prompt's prefill
        self._started: dict[str, list[float]] = {role: [] for role in self.models}
        self._handles = []

    def reset(self) -> None:
        self.calls = dict.fromkeys(self.models, 0)
        self.seconds = dict.fromkeys(self.models, 0.0)
        self.first_seconds = dict.fromkeys(self.models, 0.0)

    def __enter__(self) -> ForwardMeter:
        for role, model in self.models.items():
            self._handles.append(model.register_forward_pre_hook(self._pre(role)))
            self._handles.append(model.register_forward_hook(self._post(role)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre(self, role):
        def hook(module, args):
            self._started[role].append(time.perf_counter())
        return hook

    def _post(self, role):
        def hook(module, args, output):
            elapsed = time.perf_counter() - self._started[role].pop()
            if self.calls[role] == 0:
                self.first_seconds[role] = elapsed
            self.calls[role] += 1
            self.seconds[role] += elapsed
        return hook

    def snapshot(self) -> tuple[dict, dict]:
        return dict(self.calls), dict(self.seconds)

    def prefill_seconds(self) -> float:
        """Time of every model's first forward since reset(): the prompt's prefill (plus a first verification)."""
        return sum(self.first_seconds.values())
