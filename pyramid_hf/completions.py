"""Text a model writes itself: its completions of training prompts, as a JSONL file to train drafts on.

A draft inside the pyramid predicts the qualifier's own continuations, not human-written code; training it on the
qualifier's greedy completions of (non-benchmark) prompts puts its training data where it is measured (the on-policy
data of EAGLE-2 / HASS-style training). One line per prompt: ``{"prompt", "completion", "text"}`` (``text`` is
``prompt + completion``). Prompts are taken in their shuffled order, sorted by length within windows of a few
batches (little padding in a batch; a run stopped early still holds a sample of all prompts), and an interrupted run
resumes where it stopped: lines already in the file are kept and their prompts skipped.

    pyramid-sd write-completions --model Qwen/Qwen2.5-Coder-0.5B-Instruct --prompts stdlib-code --limit 512 --out runs/completions/qwen-coder-0.5b.jsonl
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cpu_linear import CPU_LINEAR_HELP, DTYPE_HELP, check_cpu_linear

logger = logging.getLogger("pyramid_hf")


@dataclass
class WriteCompletionsArgs:
    model: str = field(metadata={"help": "the model that writes (Hub id, local folder, GGUF): the qualifier whose "
                                         "text a draft will predict"})
    out: str = field(metadata={"help": "JSONL file to write (appended to when it exists: the run resumes)"})
    prompts: str = field(default="stdlib-code", metadata={"help": "'stdlib-code' or 'site-packages-code' (offline "
                                                                  "builders) or a Hub / saved dataset"})
    prompt_column: str = field(default="prompt", metadata={"help": "column of a Hub dataset holding the prompt"})
    limit: int | None = field(default=None, metadata={"help": "complete at most this many prompts"})
    max_new_tokens: int = field(default=128, metadata={"help": "tokens per completion (fewer at EOS)"})
    batch_size: int = field(default=32, metadata={"help": "prompts per generate() call"})
    do_sample: bool = field(default=False, metadata={"help": "sample instead of greedy decoding"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (with --do_sample)"})
    dtype: str | None = field(default=None, metadata={"help": DTYPE_HELP})
    cpu_linear: str = field(default="auto", metadata={"help": CPU_LINEAR_HELP})
    seed: int = field(default=0, metadata={"help": "seed of the prompt shuffle and of sampling"})

    def __post_init__(self):
        check_cpu_linear(self.cpu_linear)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be at least 1, got {self.limit}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not self.out.endswith(".jsonl"):
            raise ValueError(f"out must name a .jsonl file, got {self.out!r}")


def read_completions(path) -> list[dict]:
    """The records of a completions file; a torn last line (an interrupted write) is dropped, any other bad line
    raises, naming it."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                logger.warning("%s: dropping a torn last line (an interrupted write)", path)
                break
            raise ValueError(f"{path}:{number} is not a JSON line") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{path}:{number} has no 'text' string")
        records.append(record)
    return records


WINDOW_BATCHES = 8  # prompts are sorted by length within windows of this many batches


def batching_order(lengths: list[int], window: int) -> list[int]:
    """Indices of the prompts in the order they are written: the given (shuffled) order cut into windows of
    ``window`` prompts, each sorted by length. A batch then pads little, and a run stopped early holds a sample of
    the prompts (up to its last window), not the shortest ones."""
    order: list[int] = []
    for start in range(0, len(lengths), window):
        order += sorted(range(start, min(start + window, len(lengths))), key=lambda i: lengths[i])
    return order


@torch.no_grad()
def write_completions(model, tokenizer, prompts: list[str], out, *, max_new_tokens: int = 128, batch_size: int = 32,
                      do_sample: bool = False, temperature: float = 1.0) -> Path:
    """Append ``model``'s completions of the prompts not yet in ``out``; returns the path."""
    from tqdm.auto import tqdm

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_completions(out)
    with out.open("w", encoding="utf-8") as handle:  # rewrite what was kept (drops a torn line), then append
        handle.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in done)
    seen = {r.get("prompt") for r in done}
    todo = [p for p in prompts if p not in seen]
    lengths = [len(ids) for ids in tokenizer(todo, add_special_tokens=False)["input_ids"]] if todo else []
    todo = [todo[i] for i in batching_order(lengths, window=WINDOW_BATCHES * batch_size)]
    logger.info("completions: %d already in %s, %d to write", len(done), out, len(todo))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token to pad a batch with")
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    device = next(model.parameters()).device
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if do_sample else {
        "do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    try:
        bar = tqdm(total=len(todo), desc="completions", unit="prompt")
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            encoded = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            output_ids = model.generate(**encoded, max_new_tokens=max_new_tokens, pad_token_id=pad_id, **sampling)
            new_ids = output_ids[:, encoded["input_ids"].shape[1] :]
            with out.open("a", encoding="utf-8") as handle:
                for prompt, ids in zip(batch, new_ids, strict=True):
                    completion = tokenizer.decode(ids, skip_special_tokens=True)
                    handle.write(json.dumps({"prompt": prompt, "completion": completion, "text": prompt + completion},
                                            ensure_ascii=False) + "\n")
            bar.update(len(batch))
        bar.close()
    finally:
        tokenizer.padding_side = side
    return out


def run_write_completions(args: WriteCompletionsArgs) -> Path:
    from .models import load_model
    from .prompts import load_prompts
    from .trio import default_dtype

    torch.manual_seed(args.seed)
    loaded = load_model(args.model, dtype=args.dtype or default_dtype(), cpu_linear=args.cpu_linear)
    if loaded.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer to write text with")
    logger.info("writer: %s", loaded.origin)
    prompts = list(load_prompts(args.prompts, limit=args.limit, column=args.prompt_column, seed=args.seed)["prompt"])
    return write_completions(loaded.model, loaded.tokenizer, prompts, args.out, max_new_tokens=args.max_new_tokens,
                             batch_size=args.batch_size, do_sample=args.do_sample, temperature=args.temperature)
