"""Token-tree mechanics (groundwork for the tree issue): mask and positions on hand-made trees,
tree scoring through the stock model classes, and cache compaction to the accepted path."""

import pytest
import torch

from conftest import logits_of
from specdraft.core.tree import DraftTree

NEG = torch.finfo(torch.float32).min


def _tree():
    #        root
    #       /    \
    #     0(a)   1(b)
    #    /   \      \
    #  2(c)  3(d)   4(e)
    #   |
    #  5(f)
    return DraftTree(torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor([-1, -1, 0, 0, 1, 2]))


def test_mask_positions_known_answers():
    t = _tree()
    assert t.depths().tolist() == [1, 1, 2, 2, 2, 3]
    assert not t.is_chain() and DraftTree.chain([1, 2, 3]).is_chain()
    anc = t.ancestors().int().tolist()
    assert anc[5] == [1, 0, 1, 0, 0, 1] and anc[4] == [0, 1, 0, 0, 1, 0] and anc[1] == [0, 1, 0, 0, 0, 0]
    m = t.attention_mask(past_len=3, n_pending=1)[0, 0]
    assert m.shape == (7, 10)
    allowed = (m == 0).int().tolist()
    assert allowed[0] == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]  # pending token: cache + itself
    assert allowed[6] == [1, 1, 1, 1, 1, 0, 1, 0, 0, 1]  # node 5: cache, pending, 0, 2, itself
    assert allowed[5] == [1, 1, 1, 1, 0, 1, 0, 0, 1, 0]  # node 4: cache, pending, 1, itself
    assert (m[m != 0] == NEG).all()
    assert t.position_ids(past_len=3).tolist() == [[3, 4, 4, 5, 5, 5, 6]]
    m2 = DraftTree.chain([7, 8]).attention_mask(past_len=0, n_pending=2)[0, 0]
    assert (m2 == 0).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert t.path_to(5) == [0, 2, 5] and t.path_to(-1) == []


@pytest.mark.slow
def test_tree_scoring_and_compaction_match_sequential_decoding(smol_f32):
    """Through the model interface (the only path, for the target and draft models alike): a tree fed to a
    row scores each node as sequential decoding of its path; keeping the prefix + one path leaves a cache
    whose next step equals a directly built one."""
    from specdraft.core.tree import feed_mask

    m = smol_f32
    prompt = m.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    t = _tree()
    t.tokens = torch.tensor(m.tokenizer(" Paris London , . is the", add_special_tokens=False)["input_ids"][:6])
    rows = m.new_rows()
    rows.add_rows([prompt[:-1]])
    logits = rows.forward([[prompt[-1]] + t.tokens.tolist()], trees=[feed_mask(t)])[0]
    # each node's logits equal sequential decoding of its path
    for node in range(t.size):
        path = t.tokens[t.path_to(node)]
        ref = logits_of(m, torch.cat([torch.tensor(prompt), path]))[-1]
        assert torch.allclose(logits[1 + node], ref, atol=1e-3), node
    # compaction: keep the prefix + path [0, 2, 5], then the next step equals a directly built cache
    path = t.path_to(5)
    rows.commit([[0] + [1 + i for i in path]])
    rows.compact()
    nxt = m.tokenizer(" and", add_special_tokens=False)["input_ids"][0]
    got = rows.forward([[nxt]])[0, -1]
    want = logits_of(m, prompt + t.tokens[path].tolist() + [nxt])[-1]
    assert torch.allclose(got, want, atol=1e-3)


def test_greedy_verify_tree_known_answers():
    from specdraft.core.verify import greedy_verify_tree

    t = _tree()  # tokens 10..15
    logits = torch.zeros(7, 20)
    # target argmax: after root -> 10 (node 0), after node 0 -> 13 (node 3), after node 3 -> 7
    logits[0, 10] = logits[1, 13] = logits[4, 7] = 1.0
    logits[3, 15] = 1.0  # node 2's child 5 would be right, but node 2 itself is wrong
    assert greedy_verify_tree(t, logits) == ([0, 3], 7)
    logits2 = torch.zeros(7, 20)
    logits2[0, 3] = 1.0
    assert greedy_verify_tree(t, logits2) == ([], 3)


def test_prompt_lookup_tree_and_trie():
    import numpy as np

    from specdraft.core.tree import trie
    from specdraft.drafters.prompt_lookup import find_candidates

    t = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 3, 5, 6, 8, 1, 2, 3])
    c = find_candidates(t, 1, 3, 3, branches=3)
    assert [x.tolist() for x in c] == [[5, 6, 8], [5, 9, 1], [4, 9, 1]]
    tr = trie(c)
    assert tr.tokens.tolist() == [5, 6, 8, 9, 1, 4, 9, 1]
    assert tr.parents.tolist() == [-1, 0, 1, 0, 3, -1, 5, 6]


def test_tree_shapes_and_merging():
    from specdraft.core.tree import TreeShape, accepted_rows, merge_trees, trie

    shape = TreeShape.of("static", 4, branching=[2, 1])
    assert shape.static and shape.max_depth == 2 and shape.choices == ((0,), (1,), (0, 0), (1, 0))
    assert shape.children == {(): 2, (0,): 1, (1,): 1}
    explicit = TreeShape.of("static", 4, choices=[[1], [0], [0, 0], [0]])  # deduplicated, level order
    assert explicit.choices == ((0,), (1,), (0, 0)) and explicit.children == {(): 2, (0,): 1}
    dynamic = TreeShape.of("dynamic", 5, budget=10, topk=3)
    assert not dynamic.static and (dynamic.max_depth, dynamic.budget, dynamic.topk) == (5, 10, 3)
    # merging two tries is the trie of both sets of paths
    a, b = trie([[5, 6], [7]]), trie([[5, 8], [7, 1]])
    both = merge_trees(a, b)
    assert (both.tokens.tolist(), both.parents.tolist()) == ([5, 6, 7, 8, 1], [-1, 0, -1, 0, 2])
    assert torch.equal(trie([[5, 6], [7], [5, 8], [7, 1]]).tokens, both.tokens)
    # the fed rows now verified: the pending token's, then the accepted path's (the tokens pick it)
    assert accepted_rows(both, 1 + both.size, 2, [7, 1, 9]) == [0, 3, 5]
    assert accepted_rows(DraftTree.chain([4, 4, 4]), 4, 2, [4, 4, 0]) == [0, 1, 2]
