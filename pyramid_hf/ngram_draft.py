"""Free drafting from n-gram statistics: the text so far first (prompt lookup), then a corpus table.

Prompt lookup proposes only where the last tokens already occurred in the prompt or the completion. Code
has many idioms that occur in neither (``for i in range(len(``, ``    return ``, ``if __name__``), so
``CorpusNgramDraft`` adds a table built once from a corpus (by default the Python standard library's own
modules, never the benchmark): for each context of ``n`` tokens (longest first, backing off to shorter ones)
the continuation most often seen after it, proposed only when it followed that context at least
``min_count`` times and in at least ``min_share`` of them. The draft has no probabilities (like prompt
lookup), so the qualifier's exact rule treats its tokens as certain proposals and stays lossless.

The table is pure numpy: per order, sorted 64-bit context hashes with the best next token and its share.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers.generation import CandidateGenerator

logger = logging.getLogger("pyramid_hf")

NGRAM = "ngram"  # the draft source name (presets, --draft): lookup plus the standard-library table
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit constant (golden ratio): a multiplicative hash step
_FORMAT = 1


def _context_hashes(tokens: np.ndarray, order: int) -> np.ndarray:
    """uint64 hash of tokens[i - order : i] for every i in [order, len) (wrapping arithmetic)."""
    n = tokens.shape[0] - order
    h = np.zeros(max(n, 0), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(order):
            h = (h ^ tokens[j : j + n].astype(np.uint64)) * _MIX
    return h


def _hash_one(context: list[int]) -> np.uint64:
    return _context_hashes(np.asarray(context + [0], dtype=np.int64), len(context))[0]


@dataclass
class NgramTable:
    """Per order: sorted context hashes, the most frequent next token, how often it followed, its share."""

    orders: tuple
    hashes: dict  # order -> (C,) uint64, sorted
    next_ids: dict  # order -> (C,) int64
    counts: dict  # order -> (C,) int64: times the best next token followed the context
    shares: dict  # order -> (C,) float32: that count over all continuations of the context

    @classmethod
    def build(cls, token_rows, orders=(6, 5, 4, 3, 2, 1)) -> NgramTable:
        """Count every (context, next) pair of each order in ``token_rows`` (lists of ids; no pair spans rows)."""
        orders = tuple(sorted({int(o) for o in orders}, reverse=True))
        if not orders or orders[-1] < 1:
            raise ValueError(f"n-gram orders must be positive integers, got {orders}")
        rows = [np.asarray(r, dtype=np.int64) for r in token_rows if len(r) > 1]
        hashes, next_ids, counts, shares = {}, {}, {}, {}
        for order in orders:
            ctx = np.concatenate([_context_hashes(r, order) for r in rows if len(r) > order] or [np.zeros(0, np.uint64)])
            nxt = np.concatenate([r[order:] for r in rows if len(r) > order] or [np.zeros(0, np.int64)])
            hashes[order], next_ids[order], counts[order], shares[order] = _best_next(ctx, nxt)
        return cls(orders, hashes, next_ids, counts, shares)

    def __len__(self) -> int:
        return sum(h.shape[0] for h in self.hashes.values())

    def _lookup(self, context: list[int], min_count: int, min_share: float) -> tuple[int, int | None]:
        """(order, next token) of the longest order that knows ``context``'s tail confidently, else (0, None)."""
        for order in self.orders:
            if len(context) < order:
                continue
            table = self.hashes[order]
            h = _hash_one(context[-order:])
            i = int(np.searchsorted(table, h))
            if i < table.shape[0] and table[i] == h and self.counts[order][i] >= min_count \
                    and self.shares[order][i] >= min_share:
                return order, int(self.next_ids[order][i])
        return 0, None

    def predict(self, context: list[int], min_count: int = 1, min_share: float = 0.0) -> int | None:
        """The next token after ``context``, from the longest order that knows its tail confidently, else None."""
        return self._lookup(context, min_count, min_share)[1]

    def known_order(self, context: list[int], min_count: int = 1, min_share: float = 0.0) -> int:
        """The longest order whose context (``context``'s tail) the table knows confidently; 0 if none."""
        return self._lookup(context, min_count, min_share)[0]

    # ------------------------------------------------------------------ storage
    def save(self, path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {f"{name}_{o}": getattr(self, name)[o] for o in self.orders
                  for name in ("hashes", "next_ids", "counts", "shares")}
        tmp = path.with_name(path.name + ".partial")
        with open(tmp, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps({"format": _FORMAT, "orders": self.orders}).encode(), np.uint8),
                     **arrays)
        os.replace(tmp, path)  # never a half-written table under the real name

    @classmethod
    def load(cls, path) -> NgramTable:
        with np.load(path) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            if meta.get("format") != _FORMAT:
                raise ValueError(f"{path}: n-gram table format {meta.get('format')}, expected {_FORMAT}; rebuild it")
            orders = tuple(meta["orders"])
            fields = {name: {o: data[f"{name}_{o}"] for o in orders}
                      for name in ("hashes", "next_ids", "counts", "shares")}
        return cls(orders, **fields)


def _best_next(ctx: np.ndarray, nxt: np.ndarray):
    """For each distinct context hash: the most frequent next token, its count and its share."""
    if ctx.shape[0] == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
    order = np.lexsort((nxt, ctx))
    ctx, nxt = ctx[order], nxt[order]
    pair_start = np.flatnonzero(np.r_[True, (ctx[1:] != ctx[:-1]) | (nxt[1:] != nxt[:-1])])
    pair_count = np.diff(np.r_[pair_start, ctx.shape[0]])
    pair_ctx, pair_next = ctx[pair_start], nxt[pair_start]
    # per context, the pair with the largest count (ties: the smaller token id, deterministic)
    best = np.lexsort((pair_next, -pair_count, pair_ctx))
    pair_ctx, pair_next, pair_count = pair_ctx[best], pair_next[best], pair_count[best]
    ctx_start = np.flatnonzero(np.r_[True, pair_ctx[1:] != pair_ctx[:-1]])
    totals = np.add.reduceat(pair_count, ctx_start)
    return (pair_ctx[ctx_start], pair_next[ctx_start], pair_count[ctx_start],
            (pair_count[ctx_start] / totals).astype(np.float32))


def stdlib_ngram_table(tokenizer, cache_dir, orders=(6, 5, 4, 3, 2, 1), limit: int | None = None) -> NgramTable:
    """The table over the standard library's modules tokenized by ``tokenizer``, built once and cached."""
    from .prompts import corpus_cache_key, stdlib_code_files

    key = f"{corpus_cache_key(tokenizer)}-o{''.join(map(str, sorted(orders)))}-n{limit or 'all'}"
    path = Path(cache_dir) / "ngram" / f"stdlib-{key}.npz"
    if path.is_file():
        try:
            return NgramTable.load(path)
        except (OSError, ValueError, KeyError) as err:  # corrupt or old: rebuild, never use
            logger.warning("rebuilding the n-gram table %s (%s)", path, err)
    texts = stdlib_code_files(limit=limit)
    logger.info("building the standard-library n-gram table (%d modules) for the corpus draft, once", len(texts))
    rows = []
    for start in range(0, len(texts), 128):
        rows += tokenizer(texts[start : start + 128], add_special_tokens=False)["input_ids"]
    table = NgramTable.build(rows, orders)
    table.save(path)
    logger.info("n-gram table: %d contexts over %d tokens, cached at %s", len(table), sum(map(len, rows)), path)
    return table


def lookup_in_text(ids: list[int], max_ngram: int, num_tokens: int) -> tuple[int, list[int]]:
    """Prompt lookup: the longest n (<= max_ngram) whose last-n tokens occurred earlier in ``ids``, and the tokens
    that followed their most recent earlier occurrence (recent text repeats more than old text); (0, []) if none."""
    found = lookup_branches(ids, max_ngram, num_tokens, 1)
    return found[0] if found else (0, [])


def lookup_branches(ids: list[int], max_ngram: int, num_tokens: int, max_branches: int,
                    min_ngram: int = 1) -> list[tuple[int, list[int]]]:
    """Up to ``max_branches`` different continuations of earlier occurrences of the text's tail (of ``min_ngram`` to
    ``max_ngram`` tokens), as (n, tokens): longer matched tails first, the most recent occurrence first within one n."""
    arr = np.asarray(ids, dtype=np.int64)
    length = arr.shape[0]
    found, seen = [], set()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)  # starts 0 .. L-1-n
        for hit in np.flatnonzero((windows == arr[length - n :]).all(axis=1))[::-1]:
            tokens = ids[int(hit) + n : int(hit) + n + num_tokens]
            if tokens and tuple(tokens) not in seen:
                seen.add(tuple(tokens))
                found.append((n, tokens))
                if len(found) >= max_branches:
                    return found
    return found


class CorpusNgramDraft(CandidateGenerator):
    """Free n-gram drafting: prompt lookup over the text so far, or the corpus table's continuation.

    Whichever knows the longer context wins (lookup on ties within one token: text repeated in this very
    completion beats corpus averages). A Transformers `CandidateGenerator`, so it is a pyramid's draft level.
    It keeps no state between calls, so one instance serves every ``generate()`` call.

    Args:
        table: an `NgramTable` (e.g. `stdlib_ngram_table`).
        num_output_tokens: tokens proposed per call (the pyramid takes its current ``draft_tokens`` of them).
        max_ngram: longest context matched in the text so far.
        min_ngram: shortest one (a one-token match is a weak guess; raise it where a wrong proposal is costly).
        min_count, min_share: the corpus table proposes a token only if it followed its context at least
            ``min_count`` times and in at least ``min_share`` of them (raise them where a wrong proposal is
            costly; on hardware where verifying k tokens costs about one token, proposing is free).
        eos_token_id: proposals stop after an end-of-sequence token.
    """

    def __init__(self, table: NgramTable, num_output_tokens: int = 16, max_ngram: int = 4, min_count: int = 1,
                 min_share: float = 0.0, eos_token_id=None, min_ngram: int = 1):
        for name, value in (("num_output_tokens", num_output_tokens), ("max_ngram", max_ngram),
                            ("min_count", min_count), ("min_ngram", min_ngram)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        if not 0.0 <= float(min_share) <= 1.0:
            raise ValueError(f"min_share must be in [0, 1], got {min_share!r}")
        self.table, self.num_output_tokens, self.max_ngram, self.min_ngram = table, num_output_tokens, max_ngram, min_ngram
        self.min_count, self.min_share = min_count, float(min_share)
        eos = [] if eos_token_id is None else torch.as_tensor(eos_token_id).view(-1).tolist()
        self.eos_ids = set(eos)

    def propose(self, ids: list[int], num_tokens: int | None = None) -> list[int]:
        """Up to ``num_tokens`` (default ``num_output_tokens``) draft tokens after ``ids``."""
        return self.propose_branches(ids, num_tokens, 1)[0]

    def propose_branches(self, ids: list[int], num_tokens: int | None = None, max_branches: int = 4) -> list[list[int]]:
        """Up to ``max_branches`` different drafts of up to ``num_tokens`` tokens (a `pyramid_hf.tree.DraftTree`'s
        branches), best guess first: the lookup or corpus draft `propose` makes, then the other one, then other
        continuations of the text's tail found earlier in the text. ``[[]]`` when nothing is known."""
        k = self.num_output_tokens if num_tokens is None else num_tokens
        from_text = lookup_branches(ids, self.max_ngram, k, max_branches, self.min_ngram)
        n_corpus = self.table.known_order(ids, self.min_count, self.min_share)
        from_corpus = []
        while n_corpus and len(from_corpus) < k:
            token = self.table.predict(ids + from_corpus, self.min_count, self.min_share)
            if token is None:
                break
            from_corpus.append(token)
        text_first = bool(from_text) and from_text[0][0] >= n_corpus - 1
        ordered = [t for _, t in from_text[:1]] + [from_corpus] if text_first else [from_corpus] + [t for _, t in from_text[:1]]
        branches = []
        for branch in ordered + [t for _, t in from_text[1:]]:
            branch = self._cut_at_eos(branch)
            if branch and branch not in branches:
                branches.append(branch)
        return branches[:max_branches] or [[]]

    def _cut_at_eos(self, proposed: list[int]) -> list[int]:
        for i, token in enumerate(proposed):
            if token in self.eos_ids:
                return proposed[: i + 1]
        return proposed

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        if input_ids.shape[0] != 1:
            raise ValueError(f"CorpusNgramDraft drafts for batch size 1, got {input_ids.shape[0]}")
        proposed = self.propose(input_ids[0].tolist())
        if not proposed:
            return input_ids, None
        extra = torch.tensor([proposed], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, extra], dim=1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        return  # stateless
