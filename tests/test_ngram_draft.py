"""The corpus n-gram draft: its table counts right, it stores safely, and a pyramid over it stays exact."""

import numpy as np
import pytest
import torch
from tiny import VOCAB, tiny_tokenizer

from pyramid_hf import PyramidAssistant, PyramidConfig
from pyramid_hf.ngram_draft import CorpusNgramDraft, NgramTable, lookup_in_text, stdlib_ngram_table


def test_table_keeps_the_most_frequent_continuation_and_backs_off():
    rows = [[1, 2, 3], [1, 2, 3], [1, 2, 4], [9, 2, 5]]
    table = NgramTable.build(rows, orders=(2, 1))
    assert table.predict([1, 2]) == 3 and table.known_order([1, 2]) == 2  # 2 of 3 continuations of (1, 2)
    assert table.predict([7, 2]) == 3 and table.known_order([7, 2]) == 1  # (7, 2) unknown: (2,) -> 3 twice of 4
    assert table.predict([7, 2], min_share=0.6) is None  # (2,) -> 3 has share 0.5
    assert table.predict([1, 2], min_count=3) is None  # no order saw its best continuation 3 times
    assert table.predict([4, 1]) == 2  # (1,) -> 2
    assert table.predict([3]) is None and table.known_order([3]) == 0  # nothing followed 3: no pair spans rows
    assert table.predict([]) is None


def test_table_counts_and_shares_exactly():
    table = NgramTable.build([[5, 6], [5, 6], [5, 7], [5, 8], [5, 8], [5, 8]], orders=(1,))
    assert table.hashes[1].shape == (1,)  # one context: (5,)
    assert table.next_ids[1][0] == 8 and table.counts[1][0] == 3
    assert table.shares[1][0] == pytest.approx(0.5)
    assert table.predict([5], min_count=3, min_share=0.5) == 8
    assert table.predict([5], min_count=4) is None and table.predict([5], min_share=0.51) is None


def test_ties_break_to_the_smaller_id_and_orders_are_validated():
    table = NgramTable.build([[1, 9], [1, 4]], orders=(1,))
    assert table.predict([1]) == 4
    with pytest.raises(ValueError, match="orders must be positive"):
        NgramTable.build([[1, 2]], orders=(0,))


def test_save_load_round_trip_and_a_corrupt_cache_is_rebuilt(tmp_path):
    tokenizer = tiny_tokenizer()
    table = stdlib_ngram_table(tokenizer, tmp_path, orders=(2, 1), limit=3)
    files = list((tmp_path / "ngram").glob("*.npz"))
    assert len(files) == 1 and len(table) > 100
    again = stdlib_ngram_table(tokenizer, tmp_path, orders=(2, 1), limit=3)  # from the cache
    for order in table.orders:
        assert np.array_equal(again.hashes[order], table.hashes[order])
        assert np.array_equal(again.next_ids[order], table.next_ids[order])
    files[0].write_bytes(b"not a zip")
    rebuilt = stdlib_ngram_table(tokenizer, tmp_path, orders=(2, 1), limit=3)
    assert np.array_equal(rebuilt.next_ids[2], table.next_ids[2])
    assert not list((tmp_path / "ngram").glob("*.partial"))


def test_lookup_in_text_takes_the_longest_then_most_recent_match():
    ids = [1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3]
    assert lookup_in_text(ids, 4, 2) == (3, [9, 2])  # (1, 2, 3) occurred once before, then 9, 2
    assert lookup_in_text([5, 2, 3, 6, 4, 2, 3, 7, 1, 3], 3, 3) == (1, [7, 1, 3])  # most recent earlier "3"
    assert lookup_in_text([1, 2, 3], 3, 2) == (0, [])


def test_draft_prefers_text_repeats_and_falls_back_to_the_corpus():
    table = NgramTable.build([[10, 11, 12, 13, 14]] * 2, orders=(2, 1))
    draft = CorpusNgramDraft(table, num_output_tokens=3, eos_token_id=13)
    assert draft.propose([4, 10, 11]) == [12, 13]  # from the corpus, cut after EOS
    assert draft.propose([20, 21, 22, 20, 21]) == [22, 20, 21]  # the text repeats itself
    assert draft.propose([30, 31]) == []
    out, logits = draft.get_candidates(torch.tensor([[4, 10, 11]]))
    assert out.tolist() == [[4, 10, 11, 12, 13]] and logits is None
    with pytest.raises(ValueError, match="batch size 1"):
        draft.get_candidates(torch.tensor([[1, 2], [3, 4]]))
    with pytest.raises(ValueError, match="min_share"):
        CorpusNgramDraft(table, min_share=1.5)
    with pytest.raises(ValueError, match="num_output_tokens"):
        CorpusNgramDraft(table, num_output_tokens=0)
    strict = CorpusNgramDraft(table, num_output_tokens=3, min_ngram=2)
    assert strict.propose([20, 21, 22, 20, 21]) == [22, 20, 21]  # a 2-token match still counts
    assert strict.propose([5, 2, 3, 6, 4, 7, 3]) == []  # a 1-token match ("3") no longer does
    assert draft.propose([5, 2, 3, 6, 4, 7, 3]) == [6, 4, 7]
    with pytest.raises(ValueError, match=r"min_ngram \(5\) must be <= max_ngram \(4\)"):
        CorpusNgramDraft(table, min_ngram=5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("seed,max_new,l_d,l_q", [(0, 24, 2, 4), (1, 40, 4, 8), (2, 9, 3, 3)])
def test_pyramid_over_the_ngram_draft_is_exact(arch, seed, max_new, l_d, l_q, llama_trio, qwen_trio):
    target, qualifier, _ = llama_trio if arch == "llama" else qwen_trio
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed))
    expected = target.generate(prompt, do_sample=False, max_new_tokens=max_new)
    # a table from the qualifier's own greedy text: its drafts are often right, sometimes wrong
    rows = [qualifier.generate(torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(100 + i)),
                               do_sample=False, max_new_tokens=30)[0].tolist() for i in range(4)]
    assistant = PyramidAssistant(qualifier, CorpusNgramDraft(NgramTable.build(rows)),
                                 PyramidConfig(draft_tokens=l_d, qualifier_tokens=l_q))
    got = target.generate(prompt, assistant_model=assistant, do_sample=False, max_new_tokens=max_new)
    assert torch.equal(got, expected)
    stats = assistant.stats
    assert 0 < stats.draft_accepted < stats.draft_proposed  # drafts both kept and rejected
