"""Draft trees: several draft continuations checked by the qualifier in one forward pass.

On hardware where a forward pass over 17 tokens costs little more than over one (measured on this project's CPU:
Qwen2.5-Coder-0.5B 105 ms for 1 token, 108 for 5, 119 for 17; the 1.5B 263 / 272 / 300 ms), the qualifier can
check several alternative drafts at once: the draft proposes branches (e.g. every different continuation of the
current n-gram in the text so far), they are merged into a token tree (shared prefixes once), and one forward with
a tree attention mask (each node sees the sequence and its own ancestors) gives the qualifier's distribution after
every node. The accepted path's keys and values are then moved next to the sequence in the qualifier's cache and
the other nodes dropped.

- Greedy: every branch is checked with the stage's chain rule; the longest accepted prefix wins.
- Sampling: the tree is walked from the root with the stage's child rule (`pyramid_hf.acceptance.CHILD_RULES`);
  for the exact rule that is recursive rejection over the children (each proposal a point mass), so every emitted
  token is distributed exactly as the qualifier's, which the target stage needs. Taking the best of several
  branches instead would bias sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """Token tree of draft branches. Nodes are stored parents first; ``parents[i] == -1`` means node ``i`` follows
    the last token of the sequence. ``branches`` lists each proposed branch as its node indices, root to leaf."""

    ids: tuple[int, ...]
    parents: tuple[int, ...]
    branches: tuple[tuple[int, ...], ...]

    @classmethod
    def from_branches(cls, branches) -> DraftTree:
        """Merge token lists into a trie; empty and repeated branches are dropped, order is kept."""
        ids, parents, children, kept = [], [], {}, []
        for branch in branches:
            nodes, parent = [], -1
            for token in (int(t) for t in branch):
                node = children.get((parent, token))
                if node is None:
                    node = len(ids)
                    ids.append(token)
                    parents.append(parent)
                    children[(parent, token)] = node
                nodes.append(node)
                parent = node
            if nodes and tuple(nodes) not in kept and not any(k[: len(nodes)] == tuple(nodes) for k in kept):
                kept = [k for k in kept if tuple(nodes)[: len(k)] != k]  # a longer branch replaces its prefix
                kept.append(tuple(nodes))
        return cls(tuple(ids), tuple(parents), tuple(kept))

    def __len__(self) -> int:
        return len(self.ids)

    def depths(self) -> list[int]:
        """1 for children of the root, 2 for their children, ..."""
        depth = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return depth

    def ancestor_mask(self) -> torch.Tensor:
        """(N, N) bool: entry (i, j) is True iff node j is node i or one of its ancestors."""
        n = len(self.ids)
        mask = torch.eye(n, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                mask[i] |= mask[parent]
        return mask

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` ([] for the root, -1)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def branch_ids(self, b: int) -> torch.Tensor:
        return torch.tensor([self.ids[i] for i in self.branches[b]], dtype=torch.long)


def verify_tree(tree: DraftTree, branch_probs, rule, *, tau: float, divergence: str):
    """Greedy verification of every branch with ``rule`` (a registry rule; proposals are point masses).

    ``branch_probs(b)`` gives the verifier's processed distributions along branch ``b``: (len + 1, V), row 0 for the
    first draft position, the last for the position after the branch. The branch with the most accepted tokens
    wins (ties: the earlier branch). Returns (branch index, accepted count n, next token, the n + 1 rows used).
    """
    best = None
    for b in range(len(tree.branches)):
        rows = branch_probs(b)
        n, next_token = rule(tree.branch_ids(b).to(rows.device), None, rows, do_sample=False, tau=tau,
                             divergence=divergence)
        if best is None or n > best[1]:
            best = (b, n, next_token, rows[: n + 1])
    return best


def sample_tree(tree: DraftTree, node_probs, child_rule, *, tau: float, divergence: str):
    """Sampling verification: walk from the root with ``child_rule``. ``node_probs(node)`` gives the verifier's
    processed distribution (V,) after ``node`` (-1: the root). Returns (accepted path nodes, next token, the
    distributions (n + 1, V) every emitted token was drawn from)."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parents):
        children.setdefault(parent, []).append(node)
    path, rows, node = [], [], -1
    while True:
        probs = node_probs(node)
        rows.append(probs)
        kids = children.get(node, [])
        kid_ids = torch.tensor([tree.ids[k] for k in kids], dtype=torch.long, device=probs.device)
        j, token = child_rule(kid_ids, probs, tau=tau, divergence=divergence)
        if j is None:
            return path, token, torch.stack(rows)
        node = kids[j]
        path.append(node)
