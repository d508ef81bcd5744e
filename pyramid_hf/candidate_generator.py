"""The inner stage of the pyramid as a Transformers `CandidateGenerator`: draft -> qualifier.

`get_candidates` builds one block of up to ``l_Q`` qualifier tokens by repeating inner rounds:
the draft proposes up to ``l_D`` tokens, the qualifier checks them in one forward pass and the
inner rule keeps a prefix plus one token of the qualifier's own. The block goes to the target
together with the qualifier's processed logits, i.e. the distributions its tokens are distributed
by, which is what lossless verification at the target needs.
"""

from __future__ import annotations

import torch
from transformers.generation import CandidateGenerator, PromptLookupCandidateGenerator

from ._hf import supports_tree_attention
from .acceptance import CHILD_RULES, get_rule
from .config import PyramidConfig
from .feature_draft import FeatureDraft, FeatureDraftLevel
from .levels import ModelLevel, vocab_size_of
from .stats import PyramidStats
from .tree import DraftTree, sample_tree, verify_tree

PROMPT_LOOKUP = "prompt_lookup"


def process_rows(logits_processor, prefix_ids: torch.Tensor, row_logits: torch.Tensor) -> torch.Tensor:
    """Apply ``logits_processor`` to rows predicting positions after ``prefix_ids[:, :L - n + 1 + i]``.

    prefix_ids (1, L) holds the sequence whose last ``n - 1`` tokens are being verified;
    row_logits (n, V); returns processed (n, V).
    """
    if logits_processor is None or len(logits_processor) == 0:
        return row_logits
    n = row_logits.shape[0]
    start = prefix_ids.shape[1] - n + 1
    rows = [logits_processor(prefix_ids[:, : start + i], row_logits[i : i + 1]) for i in range(n)]
    return torch.cat(rows, dim=0)


def pick_token(probs_row: torch.Tensor, do_sample: bool) -> torch.Tensor:
    return torch.multinomial(probs_row, 1).squeeze(0) if do_sample else probs_row.argmax(-1)


def heuristic_update(current: int, proposed: int, accepted: int, initial: int) -> int:
    """Grow by 2 after a round that kept every proposal, shrink by 1 otherwise; within [1, 4 x initial]."""
    if proposed == 0:
        return current
    return min(4 * initial, current + 2) if accepted == proposed else max(1, current - 1)


class PyramidCandidateGenerator(CandidateGenerator):
    """Draft -> qualifier. ``draft`` is a `ModelLevel`, a `FeatureDraftLevel`, any `CandidateGenerator`, or None
    (qualifier alone)."""

    def __init__(
        self,
        qualifier: ModelLevel,
        draft: ModelLevel | CandidateGenerator | None,
        config: PyramidConfig,
        logits_processor,
        generation_config,
        stats: PyramidStats,
        attention_mask: torch.Tensor | None = None,
    ):
        if config.draft_confidence and not isinstance(draft, (ModelLevel, FeatureDraftLevel)):
            raise ValueError(f"draft_confidence={config.draft_confidence} cuts a model draft's proposals by its own "
                             f"probabilities; this pyramid's draft is {type(draft).__name__}: set draft_confidence=0")
        self.qualifier = qualifier
        self.draft = draft
        self.config = config
        self.logits_processor = logits_processor
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        eos = generation_config.eos_token_id
        self.eos_token_ids = set([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)))
        self.stats = stats
        self.attention_mask = attention_mask
        self.inner_rule = get_rule(config.qualifier_rule)
        self.draft_tokens = config.draft_tokens
        self.qualifier_tokens = config.qualifier_tokens
        # draft trees (pyramid_hf.tree): from drafts that propose branches, on attention that reads a custom mask;
        # otherwise one branch, as ever
        self.tree_branches = config.draft_branches if (
            hasattr(draft, "propose_branches") and supports_tree_attention(qualifier.model)
        ) else 1
        self.child_rule = CHILD_RULES[config.qualifier_rule]

    # ------------------------------------------------------------------ masks
    def attention_mask_for(self, length: int) -> torch.Tensor | None:
        if self.attention_mask is None:
            return None
        extra = length - self.attention_mask.shape[1]
        if extra > 0:
            ones = self.attention_mask.new_ones(1, extra)
            self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)
        return self.attention_mask

    def _probs(self, prefix_ids: torch.Tensor, row_logits: torch.Tensor) -> torch.Tensor:
        return process_rows(self.logits_processor, prefix_ids, row_logits).softmax(-1)

    # ------------------------------------------------------------------ the draft level
    def _propose(self, seq: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Up to k draft tokens after ``seq`` (1, L): ids (k',), processed probs (k', V) or None."""
        empty = seq.new_empty(0)
        if k == 0 or self.draft is None:
            return empty, None
        if isinstance(self.draft, (ModelLevel, FeatureDraftLevel)):
            ids, probs = [], []
            cur = seq
            for _ in range(k):
                logits = self.draft.next_token_logits(cur, 1, self.attention_mask_for(cur.shape[1]))
                if logits is None:  # a feature draft before the qualifier's first pass
                    break
                p = self._probs(cur, logits)[0]
                token = pick_token(p, self.do_sample)
                ids.append(token)
                probs.append(p)
                cur = torch.cat([cur, token.view(1, 1)], dim=1)
                if int(token) in self.eos_token_ids or float(p[token]) < self.config.draft_confidence:
                    break  # an unsure draft stops after this token (its own output only: lossless)
            return (torch.stack(ids), torch.stack(probs)) if ids else (empty, None)
        out_ids, out_logits = self.draft.get_candidates(seq)
        ids = out_ids[0, seq.shape[1] : seq.shape[1] + k].to(seq.device)
        if out_logits is None or ids.numel() == 0:
            return ids, None
        return ids, out_logits[0, : ids.numel()].to(device=seq.device, dtype=torch.float32).softmax(-1)

    # ------------------------------------------------------------------ one inner round
    def _tree_round(self, seq: torch.Tensor, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify a draft tree in one qualifier pass, keep the accepted path (see pyramid_hf.tree)."""
        logits = self.qualifier.tree_logits(seq, tree, self.attention_mask_for(seq.shape[1]))
        cfg = self.config
        if self.do_sample:
            def node_probs(node: int) -> torch.Tensor:
                path = tree.path_to(node)
                prefix = torch.cat([seq, torch.tensor([[tree.ids[i] for i in path]], dtype=seq.dtype,
                                                      device=seq.device)], dim=1)
                return self._probs(prefix, logits[1 + node : 2 + node])[0]

            nodes, next_token, qualifier_probs = sample_tree(tree, node_probs, self.child_rule, tau=cfg.tau_qualifier,
                                                             divergence=cfg.divergence)
            n, proposed = len(nodes), max(len(b) for b in tree.branches)
            winner = next(b for b, branch in enumerate(tree.branches) if branch[:n] == tuple(nodes))
        else:
            def branch_probs(b: int) -> torch.Tensor:
                prefix = torch.cat([seq, tree.branch_ids(b).view(1, -1).to(seq.device)], dim=1)
                return self._probs(prefix, logits[[0] + [1 + i for i in tree.branches[b]]])

            winner, n, next_token, qualifier_probs = verify_tree(tree, branch_probs, self.inner_rule,
                                                                 tau=cfg.tau_qualifier, divergence=cfg.divergence)
            nodes = tree.branches[winner][:n]
            proposed = len(tree.branches[winner])
        self.qualifier.commit_tree_path(list(nodes))
        self.stats.record_inner(proposed, n)
        self.stats.record_tree(len(tree), winner)
        if cfg.schedule == "heuristic":
            self.draft_tokens = heuristic_update(self.draft_tokens, proposed, n, cfg.draft_tokens)
        path_ids = torch.tensor([tree.ids[i] for i in nodes], dtype=seq.dtype, device=seq.device)
        return torch.cat([path_ids, next_token.view(1).to(seq.device)]), qualifier_probs

    def _inner_round(self, seq: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft k, verify with the qualifier: returns new qualifier-level ids (m,) and their probs (m, V)."""
        if self.tree_branches > 1:
            branches = self.draft.propose_branches(seq[0].tolist(), k, self.tree_branches)
            if len(branches) > 1:
                return self._tree_round(seq, DraftTree.from_branches(branches))
        draft_ids, draft_probs = self._propose(seq, k)
        proposed = torch.cat([seq, draft_ids.view(1, -1)], dim=1)
        n_draft = draft_ids.shape[0]
        logits = self.qualifier.next_token_logits(proposed, n_draft + 1, self.attention_mask_for(proposed.shape[1]))
        qualifier_probs = self._probs(proposed, logits)  # (n_draft + 1, V)
        if n_draft:
            n, next_token = self.inner_rule(
                draft_ids, draft_probs, qualifier_probs,
                do_sample=self.do_sample, tau=self.config.tau_qualifier, divergence=self.config.divergence,
            )
        else:
            n, next_token = 0, pick_token(qualifier_probs[0], self.do_sample)
        self.stats.record_inner(n_draft, n)
        if isinstance(self.draft, CandidateGenerator):
            self.draft.update_candidate_strategy(proposed, logits[None], n)
        if self.config.schedule == "heuristic" and self.draft is not None:
            self.draft_tokens = heuristic_update(self.draft_tokens, n_draft, n, self.config.draft_tokens)
        new_ids = torch.cat([draft_ids[:n], next_token.view(1)])
        return new_ids, qualifier_probs[: n + 1]

    # ------------------------------------------------------------------ CandidateGenerator API
    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Returns (input_ids + block (1, L + m), the qualifier's processed logits for the block (1, m, V))."""
        budget = min(self.qualifier_tokens, self.max_length - input_ids.shape[1] - 1)
        if budget <= 0:
            return input_ids, None
        block_ids, block_probs = [], []
        seq, size, confidence = input_ids, 0, 1.0
        while size < budget:
            k = min(self.draft_tokens, budget - size)
            new_ids, new_probs = self._inner_round(seq, k)
            block_ids.append(new_ids)
            block_probs.append(new_probs)
            seq = torch.cat([seq, new_ids.view(1, -1)], dim=1)
            size += new_ids.shape[0]
            if self.eos_token_ids and any(int(t) in self.eos_token_ids for t in new_ids):
                break
            if self.config.block_confidence:  # the qualifier's own estimate that the target keeps the whole block
                confidence *= float(new_probs.gather(1, new_ids.view(-1, 1).to(new_probs.device)).prod())
                if confidence < self.config.block_confidence:
                    break
        ids = torch.cat(block_ids)[:budget]
        probs = torch.cat(block_probs)[:budget]
        eos_at = [i for i, t in enumerate(ids.tolist()) if t in self.eos_token_ids]
        if eos_at:  # nothing after an end-of-sequence token is worth verifying
            ids, probs = ids[: eos_at[0] + 1], probs[: eos_at[0] + 1]
        return torch.cat([input_ids, ids.view(1, -1)], dim=1), probs.log()[None]

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """Called after the target's verification with the number of block tokens it kept."""
        if self.config.schedule == "heuristic":
            proposed = int(scores.shape[-2]) - 1 if scores is not None else num_matches
            self.qualifier_tokens = heuristic_update(
                self.qualifier_tokens, proposed, int(num_matches), self.config.qualifier_tokens
            )


def build_pyramid_generator(qualifier_model, draft, config: PyramidConfig, target, logits_processor, generation_config,
                            stats: PyramidStats, attention_mask=None, lookup_ngram_size: int = 2):
    """A fresh `PyramidCandidateGenerator` (fresh caches) for one generate() call.

    ``draft`` is a causal LM, a `FeatureDraft`, ``"prompt_lookup"``, a `CandidateGenerator` or None.
    """
    keep_hidden = draft.select_features if isinstance(draft, FeatureDraft) else False
    qualifier = ModelLevel(qualifier_model, "qualifier", stats, keep_hidden=keep_hidden)
    if draft == PROMPT_LOOKUP:
        eos = generation_config.eos_token_id
        eos = None if eos is None else torch.tensor([eos] if isinstance(eos, int) else list(eos))
        draft_level = PromptLookupCandidateGenerator(
            eos_token_id=eos,
            num_output_tokens=config.draft_tokens * 4,  # the heuristic schedule may grow l_D
            max_matching_ngram_size=lookup_ngram_size,
            max_length=generation_config.max_length,
            logits_processor=logits_processor,
            vocab_size=vocab_size_of(target),
        )
    elif draft is None or isinstance(draft, CandidateGenerator):
        draft_level = draft
    elif isinstance(draft, FeatureDraft):
        draft_level = FeatureDraftLevel(draft, qualifier, stats)
    else:
        draft_level = ModelLevel(draft, "draft", stats)
    return PyramidCandidateGenerator(
        qualifier, draft_level, config, logits_processor, generation_config, stats, attention_mask
    )
