"""Medusa and EAGLE heads: training (loss, checkpoints, --resume), loading checks, greedy exactness on
SmolLM2, sampling exactness through the engine on a tiny model (with a broken variant that must fail)."""

import json
import re
import shutil

import numpy as np
import pytest
import torch

from conftest import logits_of, tiny_llama, tiny_model_dir
from head_util import break_sibling_residuals, head_spec
from specdraft.cli import main
from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.core.errors import ConfigError
from specdraft.drafters.eagle import EagleDrafter
from specdraft.drafters.medusa import MedusaDrafter
from specdraft.engine import generate
from specdraft.models.heads import EagleHead, MedusaHeads, load_head
from stat_util import fit_pvalue, sample_first_tokens

PROMPTS = [
    "Tell me about cats.",
    "Write a haiku about rain.",
    "What is 2 + 3?",
    "Name three colors.",
    "Explain gravity briefly.",
    "Translate 'hello' to French.",
]


def write_prompts(path, prompts=PROMPTS):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def train(kind, target, data, out, steps, *extra):
    args = [
        "train",
        kind,
        "--target",
        str(target),
        "--data",
        str(data),
        "-o",
        str(out),
        "--steps",
        str(steps),
        "--threads",
        "1",
        *map(str, extra),
    ]
    assert main(args) == 0
    return json.loads((out / "config.json").read_text())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny_target"))


# --- training, checkpoints, resume, reload ---------------------------------------------------------
@pytest.mark.parametrize(
    "kind,extra",
    [
        ("medusa", ["--batch-size", 16, "--heads", 2, "--lr", 1e-2]),
        ("eagle", ["--batch-size", 1, "--lr", 3e-3, "--draft-vocab", 300]),
    ],
)
def test_train_lowers_loss_resumes_and_reloads(tmp_path, tiny_dir, kind, extra):
    data = write_prompts(tmp_path / "p.jsonl")
    common = ["--max-new-tokens", 12, "--checkpoint-every", 3, *extra]
    straight = tmp_path / "straight"
    cfg = train(kind, tiny_dir, data, straight, 12, *common)
    state = torch.load(straight / "train_state.pt", weights_only=True)
    losses = state["losses"]
    assert cfg["step"] == 12 and len(losses) == 12
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    assert cfg["type"] == kind and cfg["target"] == str(tiny_dir) and "command" in cfg and cfg["data"] == str(data)

    # interrupted at step 6, then --resume to 12: the same weights as the uninterrupted run, which
    # needs both the step count (batches are seeded by step) and the optimizer state
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(straight / "data.pt", resumed / "data.pt")  # cached data: not regenerated
    assert train(kind, tiny_dir, data, resumed, 6, *common)["step"] == 6
    assert train(kind, tiny_dir, data, resumed, 12, *common, "--resume")["step"] == 12
    from safetensors.torch import load_file

    a, b = load_file(str(straight / "head.safetensors")), load_file(str(resumed / "head.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    # resuming without the optimizer state would not reproduce it
    st = torch.load(resumed / "train_state.pt", weights_only=True)
    assert st["step"] == 12 and len(st["optimizer"]["state"]) > 0

    # the checkpoint reloads and drafts; greedy output equals plain
    from specdraft.api import SpecDecoder
    from specdraft.models.backends import load_model

    dec = SpecDecoder(load_model(str(tiny_dir), "float32"))
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = dec.generate("Tell me about cats.", sampling=sp, spec=SpecConfig(method="plain"))
    out = dec.generate("Tell me about cats.", sampling=sp, spec=SpecConfig(method=kind, head=str(straight), k=2))
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0
    if kind == "eagle":  # an EAGLE-2 dynamic tree through the config and the decoder
        spec = SpecConfig.from_dict({"method": "eagle", "head": str(straight), "tree": "dynamic", "k": 3})
        out = dec.generate("Tell me about cats.", sampling=sp, spec=spec)
        assert out.token_ids == plain.token_ids and any(s.depth for s in out.stats.steps)


# --- bad input -------------------------------------------------------------------------------------
def test_bad_head_inputs(tmp_path, tiny_dir, capsys):
    from specdraft.api import SpecDecoder
    from specdraft.models.backends import load_model

    # validation reads no files: a missing or wrong head is found when it is loaded (generate, the
    # server's admission, the CLI before it loads a model), with the same message
    SpecConfig(method="medusa", head=str(tmp_path / "nope")).validate()
    dec = SpecDecoder(load_model(str(tiny_dir), "float32"))
    with pytest.raises(ConfigError, match="not found"):
        dec.generate([1, 2, 3], spec=SpecConfig(method="medusa", head=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="needs head=DIR"):
        SpecConfig(method="eagle").validate()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a head directory"):
        dec.generate([1, 2, 3], spec=SpecConfig(method="medusa", head=str(tmp_path / "empty")))

    data = write_prompts(tmp_path / "p.jsonl", PROMPTS[:2])
    hd = tmp_path / "head"
    train("medusa", tiny_dir, data, hd, 1, "--max-new-tokens", 4, "--batch-size", 8, "--heads", 2)
    with pytest.raises(ConfigError, match="medusa, eagle, eagle3 and auto only, not 'prompt_lookup'"):
        SpecConfig(method="prompt_lookup", head=str(hd)).validate()
    with pytest.raises(ConfigError, match="is a medusa head; method 'eagle' needs an? eagle head"):
        dec.generate([1, 2, 3], spec=SpecConfig(method="eagle", head=str(hd)))
    assert (
        main(
            [
                "generate",
                "--target",
                str(tiny_dir),
                "--dtype",
                "float32",
                "--method",
                "layer_skip",
                "--head",
                str(hd),
                "hi",
            ]
        )
        == 2
    )
    assert "medusa, eagle, eagle3 and auto only" in capsys.readouterr().err
    assert main(["generate", "--target", "no-such-model", "--method", "eagle", "--head", str(hd), "hi"]) == 2
    assert "is a medusa head; method 'eagle' needs a" in capsys.readouterr().err  # before loading the model

    other = load_model(str(tiny_model_dir(tmp_path / "three_layers", layers=3)), "float32")
    trained_for = re.escape(repr(str(tiny_dir)))  # the target the head's config records
    with pytest.raises(
        ConfigError, match=f"num_hidden_layers=2 \\(target {trained_for}\\); this target has num_hidden_layers=3"
    ):
        load_head(hd, other, "medusa")
    same_shape = load_model(str(tiny_dir), "float32")
    with torch.no_grad():
        same_shape.model.get_output_embeddings().weight.mul_(1.5)
    with pytest.raises(ConfigError, match=f"trained for target {trained_for}, whose LM head weights differ"):
        load_head(hd, same_shape, "medusa")
    with pytest.raises(ConfigError, match="tree is 3 deep but the Medusa head has 2 heads"):
        MedusaDrafter(same_shape, MedusaHeads(32, 2), head_spec("medusa", tree="static", tree_branching=[1, 1, 1]))


# --- sampling exactness through the engine (tiny model, first two tokens vs the exact joint) -------
V = 6
PROMPT = [1, 2, 3, 1, 2]
N = 1200
T1 = SamplingParams(temperature=1.0)
TRUNC = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_llama(vocab=V, hidden=32)


def random_medusa(n_heads=3):
    torch.manual_seed(3)
    h = MedusaHeads(32, n_heads)
    with torch.no_grad():
        for p in h.parameters():
            p.normal_(0, 0.3)
    return h.eval()


def random_eagle(target, ids=None):
    torch.manual_seed(4)
    h = EagleHead(target.facts, ids)
    with torch.no_grad():
        for p in h.parameters():
            if p.dtype.is_floating_point:
                p.add_(torch.randn_like(p) * 0.05)
    return h.eval()


def exact_first_three(target, sp):
    """The target's exact joint distribution of its first three tokens after PROMPT [V, V, V]."""
    from specdraft.core.sampling import probs_from_logits

    def p_next(ctx):
        return probs_from_logits(logits_of(target, ctx)[-1], sp).double()

    joint = np.zeros((V, V, V))
    p1 = p_next(PROMPT)
    for a in range(V):
        p2 = p_next(PROMPT + [a])
        for b in range(V):
            joint[a, b] = (p1[a] * p2[b] * p_next(PROMPT + [a, b])).numpy()
    return joint


def sample_first_three(target, make_drafter, sp, max_new, n=N):
    """The engine's first step is a plain prefill step (no feature yet); the next step is the first
    drafted one, so tokens 2 and 3 come from the heads' draft and its verification. -> (counts of the
    first three tokens, draft tokens drafted / accepted in the steps that made those tokens)."""
    return sample_first_tokens(target, make_drafter, PROMPT, sp, max_new, 3, n, V, seed0=20_000)


def broken_topk_as_sampled(q, m, gen):
    """Broken on purpose: deterministic top-m candidates passed to the verifier as if drawn from q."""
    m = min(m, int((q > 0).sum()))
    return torch.topk(q, m).indices, q.expand(m, -1).clone()


CHOICES = [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0]]
CASES = [
    ("medusa_tree", 4, TRUNC),
    ("medusa_chain", 3, T1),
    ("eagle", 4, T1),
    ("eagle_reduced_vocab", 4, TRUNC),
    ("eagle_tree", 4, T1),
    ("eagle_tree", 4, TRUNC),
    ("eagle_tree_reduced_vocab", 4, TRUNC),
]
EAGLE_TREE = dict(tree="dynamic", tree_topk=2, tree_budget=5)


def factory(target, method, patch=None):
    """-> a maker of drafters of ``method`` over one random head (a drafter serves one request);
    ``patch(drafter)`` (optional) breaks each on purpose."""
    if method.startswith("medusa"):
        tree = dict(tree="static", tree_choices=CHOICES) if method == "medusa_tree" else dict(k=3)
        head, spec, cls = random_medusa(), head_spec("medusa", **tree), MedusaDrafter
    else:
        ids = torch.tensor([0, 2, 3, 5]) if method.endswith("reduced_vocab") else None
        tree = EAGLE_TREE if method.startswith("eagle_tree") else {}
        head, spec, cls = random_eagle(target, ids), head_spec("eagle", k=3, **tree), EagleDrafter

    def make():
        d = cls(target, head, spec)
        if patch is not None:
            patch(d)
        return d

    return make


@pytest.mark.parametrize("method,max_new,sp", CASES, ids=[f"{m}-{n}-T{s.temperature}" for m, n, s in CASES])
def test_sampling_first_three_tokens_match_target(tiny_target, method, max_new, sp):
    counts, drafted, accepted = sample_first_three(tiny_target, factory(tiny_target, method), sp, max_new)
    # not vacuous: the tested tokens went through drafting and verification, with acceptances and rejections
    assert 0 < accepted < drafted, (accepted, drafted)
    assert fit_pvalue(counts, exact_first_three(tiny_target, sp)) > 1e-3


# --- EAGLE token trees on the tiny model: the tree mask and positions, greedy exactness ---------------
@pytest.mark.parametrize(
    "shape",
    [dict(tree="dynamic", k=4, tree_topk=3, tree_budget=40), dict(tree="static", tree_branching=[3, 2, 2, 1])],
    ids=["dynamic", "static"],
)
def test_eagle_tree_level_equals_feeding_the_path(tiny_target, shape):
    """Every tree node's predicted feature (one head forward per tree level, 4D tree mask over the head's
    cache) equals feeding the true pairs and then the node's path one pair at a time with a causal
    cache: catches a wrong position id or a missing / extra visible slot, even with random weights.
    Two proposes: the second starts from the head's cache cropped back to its true positions."""
    head = random_eagle(tiny_target)
    d = EagleDrafter(tiny_target, head, head_spec("eagle", **shape))
    d.begin(PROMPT, SamplingParams(), None)
    embed = tiny_target.model.get_input_embeddings()
    g = torch.Generator().manual_seed(1)
    tokens, feats = [1, 2, 3, 1, 2, 0, 4], torch.randn(6, 32, generator=g)
    for _ in range(2):
        d.feats = feats
        tree = d.propose(tokens, 10)
        n = len(tokens)
        fed, grown = [i for i in d._pf if i >= 0], d._tree  # the tree it grew (a GrowingTree)
        assert int(tree.depths().max()) == 4 and max(len(grown.paths[i]) for i in fed) == 3
        if shape["tree"] == "static":  # a level of nodes under different parents
            assert len({grown.parents[i] for i in fed if len(grown.paths[i]) == 3}) == 6
        with torch.no_grad():
            for i in fed:
                cache = head.new_cache()
                f = head(
                    feats[None],
                    embed(torch.tensor(tokens[1:]))[None],
                    cache=cache,
                    position_ids=torch.arange(n - 1)[None],
                )[0, -1]
                for depth, a in enumerate(grown.paths[i], 1):  # the chain's positions: n - 2 + depth
                    f = head(
                        f[None, None],
                        embed(torch.tensor([[grown.tokens[a]]])),
                        cache=cache,
                        position_ids=torch.tensor([[n - 2 + depth]]),
                    )[0, -1]
                torch.testing.assert_close(d._pf[i], f, rtol=1e-4, atol=1e-5)
        tokens, feats = tokens + [5, 1], torch.cat([feats, torch.randn(2, 32, generator=g)])


@pytest.mark.parametrize(
    "tree",
    [dict(tree="dynamic", k=4, tree_topk=3, tree_budget=8), dict(tree="static", tree_branching=[3, 2, 1])],
    ids=["dynamic", "static"],
)
@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "reduced_vocab"])
def test_eagle_tree_greedy_equals_plain(tiny_target, tree, reduced):
    from specdraft.drafters.base import NoDrafter

    ids = torch.tensor([0, 2, 3, 5]) if reduced else None
    d = EagleDrafter(tiny_target, random_eagle(tiny_target, ids), head_spec("eagle", **tree))
    sp = SamplingParams(max_new_tokens=30)
    accepted = 0
    for prompt in (PROMPT, [3, 3, 1, 0, 4, 2, 1]):
        out = generate(tiny_target, d, prompt, sp, eos_ids=set())
        assert out.token_ids == generate(tiny_target, NoDrafter(), prompt, sp, eos_ids=set()).token_ids
        assert sum(s.depth is not None for s in out.stats.steps) >= len(out.stats.steps) // 2  # token trees
        accepted += out.stats.accepted
    assert accepted > 0


def test_broken_medusa_variant_is_detected(tiny_target):
    make = factory(tiny_target, "medusa_tree", lambda d: setattr(d, "draw_children", broken_topk_as_sampled))
    counts, drafted, _ = sample_first_three(tiny_target, make, TRUNC, 4)
    assert drafted > 0
    assert fit_pvalue(counts, exact_first_three(tiny_target, TRUNC)) < 1e-3


def test_broken_eagle_tree_variant_is_detected(tiny_target, monkeypatch):
    """Broken on purpose: siblings drawn without replacement, but each records the parent's full q."""
    break_sibling_residuals(monkeypatch)
    make = factory(tiny_target, "eagle_tree")
    counts, drafted, _ = sample_first_three(tiny_target, make, TRUNC, 4, n=3 * N)  # a subtle bug: more samples
    assert drafted > 0
    assert fit_pvalue(counts, exact_first_three(tiny_target, TRUNC)) < 1e-3


# --- greedy exactness on SmolLM2-135M float32 ---------------------------------------------------------
@pytest.fixture(scope="module")
def smol_heads(tmp_path_factory):
    d = tmp_path_factory.mktemp("smol_heads")
    data = write_prompts(d / "p.jsonl")
    medusa, eagle = d / "medusa", d / "eagle"
    train(
        "medusa",
        "smollm2-135m",
        data,
        medusa,
        30,
        "--max-new-tokens",
        32,
        "--batch-size",
        64,
        "--heads",
        3,
        "--lr",
        3e-3,
        "--checkpoint-every",
        30,
    )
    medusa.joinpath("data.pt").rename(d / "data.pt")
    eagle.mkdir()
    shutil.copy(d / "data.pt", eagle / "data.pt")
    train(
        "eagle",
        "smollm2-135m",
        data,
        eagle,
        30,
        "--max-new-tokens",
        32,
        "--batch-size",
        2,
        "--lr",
        1e-3,
        "--checkpoint-every",
        30,
        "--draft-vocab",
        4096,
    )
    return medusa, eagle


GREEDY_PROMPTS = ["def fibonacci(n):", "Once upon a time, there was a"]  # 2 (3 before; CI time)


@pytest.mark.slow
def test_greedy_exact_on_smollm2(smol_f32, smol_heads):
    from specdraft.api import SpecDecoder

    medusa, eagle = smol_heads
    dec = SpecDecoder(smol_f32)
    sp = SamplingParams(max_new_tokens=32, ignore_eos=True)
    specs = {
        "medusa_chain": SpecConfig(method="medusa", head=str(medusa), k=3),
        "medusa_tree": SpecConfig(
            method="medusa", head=str(medusa), tree="static", tree_choices=[[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]]
        ),
        "eagle": SpecConfig(method="eagle", head=str(eagle), k=3),
        "eagle_tree": SpecConfig(method="eagle", head=str(eagle), tree="dynamic", k=3, tree_topk=2, tree_budget=6),
    }
    accepted = {m: 0 for m in specs}
    for p in GREEDY_PROMPTS:
        ref = dec.generate(p, sampling=sp, spec=SpecConfig(method="plain")).token_ids
        for m, spec in specs.items():
            if m == "eagle_tree" and p != GREEDY_PROMPTS[0]:
                continue  # one prompt: the tree path is the same for all
            out = dec.generate(p, sampling=sp, spec=spec)
            assert out.token_ids == ref, (m, p)
            accepted[m] += out.stats.accepted
    assert all(v > 0 for v in accepted.values()), accepted
