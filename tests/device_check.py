"""Device check (needs a CUDA GPU; not collected by pytest): every level on its own device stays lossless.

    python tests/device_check.py [DRAFT_KIND ...]   # all of model, feature, prompt_lookup, ngram_tree by default

Greedy pyramid output is compared token for token with the target decoding alone, with the three levels placed
on different devices (CUDA / CPU), with a feature draft reading a qualifier on another device, and with n-gram
draft trees (one qualifier pass over several drafts: tree attention mask, cache rearranged). Tiny random
models in float64 (no near-tie argmax can flip between batched and single-token kernels) and float32. Prints
one line per case and exits non-zero when any case differs.
"""

from __future__ import annotations

import itertools
import sys

import torch
from tiny import VOCAB, tiny_model

from pyramid_hf import FeatureDraft, PyramidAssistant, PyramidConfig
from pyramid_hf.ngram_draft import CorpusNgramDraft, NgramTable

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
PLACEMENTS = [  # (target, qualifier, draft)
    (CUDA, CUDA, CUDA), (CUDA, CPU, CUDA), (CPU, CUDA, CPU), (CUDA, CUDA, CPU), (CUDA, CPU, CPU)]
DRAFTS = ("model", "feature", "prompt_lookup", "ngram_tree")


def case(arch: str, dtype, placement, draft_kind: str, seed: int) -> tuple[bool, str]:
    target_device, qualifier_device, draft_device = placement
    target = tiny_model(arch, 64, 3, seed, init=0.3).to(target_device, dtype)
    qualifier = tiny_model(arch, 32, 2, seed + 1, init=0.3)
    if draft_kind == "feature":
        draft = FeatureDraft.from_qualifier(qualifier, seed=seed)
        with torch.no_grad():
            draft.fc.weight.normal_(0, 0.1)
        draft = draft.to(draft_device, dtype)
    elif draft_kind == "model":
        draft = tiny_model(arch, 16, 2, seed + 2, init=0.3).to(draft_device, dtype)
    elif draft_kind == "ngram_tree":  # a table from the qualifier's own text: right and wrong branches
        rows = [qualifier.generate(input_ids=torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(
            100 + i)), max_new_tokens=30, do_sample=False)[0].tolist() for i in range(4)]
        draft = CorpusNgramDraft(NgramTable.build(rows))
    else:
        draft = draft_kind
    qualifier = qualifier.to(qualifier_device, dtype)
    ids = torch.randint(3, VOCAB, (1, 5 + seed), generator=torch.Generator().manual_seed(seed)).to(target_device)
    want = target.generate(input_ids=ids, max_new_tokens=48, do_sample=False)
    branches = 4 if draft_kind == "ngram_tree" else 1
    assistant = PyramidAssistant(qualifier, draft, PyramidConfig(draft_tokens=3, qualifier_tokens=6,
                                                                 draft_branches=branches))
    got = target.generate(input_ids=ids, max_new_tokens=48, do_sample=False, assistant_model=assistant)
    if branches > 1 and not assistant.stats.tree_rounds:
        return False, "no draft tree was checked: " + assistant.stats.summary()
    return torch.equal(got, want), assistant.stats.summary()


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here")
        return 2
    print(torch.cuda.get_device_name(0), "torch", torch.__version__)
    drafts = tuple(sys.argv[1:]) or DRAFTS
    unknown = sorted(set(drafts) - set(DRAFTS))
    if unknown:
        print(f"unknown draft kinds {unknown}; choose from {DRAFTS}")
        return 2
    failures = 0
    for arch, dtype, placement, draft_kind, seed in itertools.product(
            ("llama", "qwen2"), (torch.float64, torch.float32), PLACEMENTS, drafts,
            (0,)):
        try:
            ok, summary = case(arch, dtype, placement, draft_kind, seed)
        except Exception as error:  # a crash is a failed case; the others still run
            ok, summary = False, f"{type(error).__name__}: {str(error)[:300]}"
        failures += not ok
        where = "/".join(d.type for d in placement)
        print(f"{'ok  ' if ok else 'DIFF'} {arch:5s} {str(dtype)[6:]:7s} T/Q/D {where:14s} {draft_kind:13s} seed {seed}: "
              f"{summary}")
    print(f"{failures} of {2 * 2 * len(PLACEMENTS) * len(drafts)} cases differ from the target alone")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
