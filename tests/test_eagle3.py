"""EAGLE-3 (models/eagle3.py, drafters/eagle3.py, `specdraft train eagle3`): the target's layer
features handed over in the verifying forward equal a plain forward's; greedy output equals plain
decoding on SmolLM2 float32 (chain and dynamic tree) with a briefly trained head; the first two
sampled tokens follow the exact target distribution on a tiny model, and two broken variants fail
(q of the draft vocabulary left unnormalized; a tree's siblings recording the parent's q); training
resumes to the weights of an uninterrupted run; a Qwen-sized head of the default shape fits under 50 MB
in int8. Checkpoints of other engines' formats: tests/test_head_formats.py."""

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import logits_of, tiny_llama
from head_util import break_sibling_residuals, head_spec, random_eagle3_head
from specdraft.cli import main
from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.drafters import eagle as eagle_mod
from specdraft.drafters.eagle3 import Eagle3Drafter
from specdraft.models.eagle3 import Eagle3Head, Eagle3Shape, eagle3_layers
from specdraft.models.head_formats import int8_rows
from stat_util import fit_pvalue, sample_first_tokens
from test_greedy_real import NEW
from test_greedy_real import PROMPTS as GREEDY_PROMPTS


# --- the hand-over: the layers' outputs of a verifying forward = output_hidden_states of a plain one -----
def plain_layers(target, ids, layers) -> torch.Tensor:
    with torch.inference_mode():
        out = target.model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.last_hidden_state[0]] + [out.hidden_states[i][0] for i in layers], -1)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["float32", "bfloat16", "w8a8"])
def test_hand_over_equals_a_plain_forward(smol_variant, smol_f32, variant):
    """Prefill, a chain and a token tree handed over through the rows (forward hooks) against a separate
    forward with output_hidden_states: bit-equal for the same feed, within float error when the same
    tokens come in pieces through the cache. A hook on the wrong layer (i instead of i - 1) fails."""
    if variant == "w8a8":
        from specdraft.models.backends import load_model

        target = load_model("smollm2-135m:w8a8", "float32")
    else:
        target = smol_f32 if variant == "float32" else smol_variant(variant)
    layers = eagle3_layers(target.num_layers)
    blocks = target.add_feature_layers(layers)
    assert blocks == [1 + target.feature_layers.index(i) for i in layers]
    H, cols = target.config.hidden_size, [0] + blocks
    pick = lambda h: torch.cat([h[..., b * H : (b + 1) * H] for b in cols], -1).float()  # noqa: E731
    ids = [1, 504, 3458, 314, 253, 1345, 28, 216, 33]
    rows = target.new_rows()
    rows.add_rows([[]])
    rows.forward([ids], hidden=True)
    torch.testing.assert_close(pick(rows.last_hidden[0]), plain_layers(target, ids, layers).float(), rtol=0, atol=0)
    if variant != "float32":
        return
    rows = target.new_rows()
    rows.add_rows([ids[:5]], hidden=True)
    rows.forward([ids[5:7]], hidden=True)
    got = torch.cat([rows.prefill_hidden[0], rows.last_hidden[0]])
    rows.commit([2])
    # a tree after ids[:7]: node 0 = ids[7], node 1 = ids[8] under it, node 2 = another child of the root
    allow = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    rows.forward([[ids[7], ids[8], 42]], trees=[(allow, torch.tensor([0, 1, 0]))], hidden=True)
    tree = rows.last_hidden[0]
    want = plain_layers(target, ids, layers)
    torch.testing.assert_close(pick(got), want[:7], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(pick(tree[:2]), want[7:9], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(pick(tree[2:]), plain_layers(target, ids[:7] + [42], layers)[7:], rtol=1e-4, atol=1e-3)


# --- a briefly trained head on SmolLM2 through the command (data, training, checkpoints, resume) --------
def train(out, steps, *extra):
    args = [
        "train",
        "eagle3",
        "--target",
        "smollm2-135m",
        "-o",
        str(out),
        "--steps",
        str(steps),
        "--threads",
        "1",
        "--max-new-tokens",
        str(NEW),
        "--gen-backend",
        "hf",
        "--intermediate-size",
        "256",
        "--draft-vocab",
        "2048",
        "--ttt-steps",
        "3",
        "--lr",
        "1e-3",
        "--checkpoint-every",
        "6",
        *map(str, extra),
    ]
    assert main(args) == 0
    return json.loads((out / "config.json").read_text())


@pytest.fixture(scope="module")
def smol_eagle3(tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle3")
    data = d / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in GREEDY_PROMPTS[:3]))
    cfg = train(d / "head", 12, "--data", data)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["specdraft"]["step"] == 12
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # vLLM's ids; SGLang's one lower
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    return d, data


@pytest.mark.slow
def test_training_resumes_to_the_uninterrupted_weights(smol_eagle3):
    """Stopped at step 6 and resumed to 12 on the same data: the float32 weights of the uninterrupted run
    (batches seeded by step, the optimizer state restored). Fails without the restored optimizer state."""
    d, data = smol_eagle3
    resumed = d / "resumed"
    (resumed / "data").mkdir(parents=True)
    for f in (d / "head" / "data").iterdir():  # the data is reused, not made again
        shutil.copy(f, resumed / "data" / f.name)
    assert train(resumed, 6, "--data", data)["specdraft"]["step"] == 6
    assert train(resumed, 12, "--data", data, "--resume")["specdraft"]["step"] == 12
    a = torch.load(d / "head" / "train_state.pt", weights_only=True)
    b = torch.load(resumed / "train_state.pt", weights_only=True)
    assert len(a["losses"]) == 12 and a["losses"][-1] < a["losses"][0]
    for k in a["weights"]:
        torch.testing.assert_close(a["weights"][k], b["weights"][k], rtol=0, atol=0)


@pytest.mark.slow
def test_greedy_equals_plain_on_smollm2(smol_f32, smol_reference, smol_eagle3):
    from specdraft.api import SpecDecoder

    head = str(smol_eagle3[0] / "head")
    dec = SpecDecoder(smol_f32)
    sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    specs = [
        SpecConfig(method="eagle3", head=head, k=4),
        SpecConfig(method="eagle3", head=head, tree="dynamic", k=4, tree_topk=3, tree_budget=10),
    ]
    for spec, prompts in zip(specs, (GREEDY_PROMPTS[:2], GREEDY_PROMPTS[:1])):
        accepted = 0
        for p in prompts:
            out = dec.generate(p, sampling=sp, spec=spec, chat=True)
            assert out.token_ids == smol_reference[p], (spec.tree, p)
            accepted += out.stats.accepted
        assert accepted > 0, spec.tree


# --- sampling: the first two tokens against the exact target (tiny model, random heads) ---------------
V = 6
PROMPT = [1, 2, 3, 1, 2]
N = 1200
T1 = SamplingParams(temperature=1.0)
TRUNC = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
DRAFT_IDS = torch.tensor([0, 2, 3, 5])  # two target tokens the draft cannot propose


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_llama(vocab=V, hidden=32, layers=4)


def random_head(target):
    return random_eagle3_head(target, DRAFT_IDS)


def exact_first_two(target, sp):
    from specdraft.core.sampling import probs_from_logits

    p = lambda ctx: probs_from_logits(logits_of(target, ctx)[-1], sp).double()  # noqa: E731
    p1 = p(PROMPT)
    return np.stack([(p1[a] * p(PROMPT + [a])).numpy() for a in range(V)])


def first_two(target, spec, sp, patch=None):
    head = random_head(target)

    def make():
        d = Eagle3Drafter(target, head, spec)
        if patch is not None:
            patch(d)
        return d

    counts, drafted, accepted = sample_first_tokens(target, make, PROMPT, sp, 3, 2, N, V, seed0=30_000)
    assert 0 < accepted < drafted, (accepted, drafted)  # the second token went through verification
    return fit_pvalue(counts, exact_first_two(target, sp))


CHAIN = head_spec("eagle3", k=3)
TREE = head_spec("eagle3", tree="dynamic", k=3, tree_topk=4, tree_budget=8)


@pytest.mark.parametrize("spec,sp", [(CHAIN, TRUNC), (TREE, T1)], ids=["chain-trunc", "tree-T1"])
def test_sampling_first_two_tokens_match_target(tiny_target, spec, sp):
    assert first_two(tiny_target, spec, sp) > 1e-3


def test_unnormalized_draft_vocabulary_q_is_detected(tiny_target, monkeypatch):
    """Broken on purpose: the tokens outside the draft vocabulary given the largest draft logit instead of
    -inf, q then cut back to the draft vocabulary without renormalizing (it sums to less than 1; the token
    is still drawn from the normalized q, so only the reported q is wrong)."""
    real = eagle_mod.probs_from_logits

    def unnormalized(logits, sp):
        off = torch.isinf(logits)
        top = logits.masked_fill(off, float("-inf")).amax(-1, keepdim=True)
        return real(torch.where(off, top, logits), sp).masked_fill(off, 0.0)

    monkeypatch.setattr(eagle_mod, "probs_from_logits", unnormalized)
    assert first_two(tiny_target, CHAIN, T1) < 1e-3


def test_skipped_sibling_residual_is_detected(tiny_target, monkeypatch):
    """Broken on purpose: siblings drawn without replacement, but each records the parent's full q."""
    break_sibling_residuals(monkeypatch)
    assert first_two(tiny_target, TREE, T1) < 1e-3


# --- the shipped size -----------------------------------------------------------------------------
def test_qwen_head_ships_under_50_mb():
    """The default head for Qwen2.5-Coder-1.5B (28 layers, H 1536, vocabulary 151,936), reference layout,
    stored as int8: 44M parameters, under 50 MB (with the target's MLP width, 8960, and a 32k draft
    vocabulary it would not fit)."""
    from specdraft.commands.train.eagle3 import EAGLE3_DRAFT_VOCAB, EAGLE3_INTERMEDIATE
    from specdraft.models.base import ModelFacts

    facts = ModelFacts("qwen2", 1536, 28, 151936, 12, 2, 128, 8960, 1e-6, 1e6, 32768)
    head = Eagle3Head(Eagle3Shape.for_target(facts, eagle3_layers(28), EAGLE3_DRAFT_VOCAB, EAGLE3_INTERMEDIATE))
    assert head.layers == (2, 14, 25)
    n = head.parameter_count()
    size = sum(v.numel() * v.element_size() for v in int8_rows(head.state_dict()).values())
    assert 43e6 < n < 45e6 and size < 50e6, (n, size)


@pytest.mark.slow
def test_openvino_hands_over_the_same_layers(tmp_path):
    """OpenVINO's extra outputs (the IR edited like its attention-bias input): a prefill + chain through
    the rows against one plain forward of the whole text on the same backend (its bf16 / int8 numerics:
    cosine per position), and each block against the dense transformers copy's output_hidden_states,
    closer to the named layer than to the next one (a node of the wrong layer fails)."""
    pytest.importorskip("openvino")
    from specdraft.core.errors import ModelFileError
    from specdraft.models import quantize
    from specdraft.models.backends import load_model

    name = "qwen2.5-coder-0.5b"
    try:
        quantize.variant_path(name, "Q4_0")
    except ModelFileError:
        quantize.quantize(name, "Q4_0")
    ov = load_model(f"{name}:Q4_0", backend="openvino")
    layers = eagle3_layers(ov.num_layers)
    assert ov.add_feature_layers(layers) == [1, 2, 3]
    ids = ov.tokenizer(
        "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b", add_special_tokens=False
    )["input_ids"]
    rows = ov.new_rows()
    rows.add_rows([ids[:9]], hidden=True)
    rows.forward([ids[9:]], hidden=True)
    split = torch.cat([rows.prefill_hidden[0], rows.last_hidden[0]])
    fresh = ov.new_rows()
    fresh.add_rows([[]])
    fresh.forward([ids], hidden=True)
    whole = fresh.last_hidden[0]
    dense = load_model(name, "float32")
    ref = plain_layers(dense, ids, layers)
    H = dense.config.hidden_size
    cos = lambda a, b: torch.nn.functional.cosine_similarity(a, b, dim=-1)[1:].median()  # noqa: E731
    with torch.inference_mode():
        hs = dense.model.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    for b, nxt in enumerate([hs[-2][0]] + [hs[i + 1][0] for i in layers]):
        got, want = whole[:, b * H : (b + 1) * H], ref[:, b * H : (b + 1) * H]
        assert cos(split[:, b * H : (b + 1) * H], got) > 0.97, b  # measured 0.98 at layer 2, 0.995+ above
        assert cos(got, want) > 0.95 and cos(got, want) > cos(got, nxt) + 0.02, b  # Q4_0 against the Q4_K_M copy


@pytest.mark.slow
def test_auto_drafts_with_the_eagle3_arm(smol_f32, smol_reference, smol_eagle3):
    """auto with an eagle3 head: its arms include eagle3's chain and tree; with suffix beside them (a
    tree another arm drafts, whose accepted path the eagle3 drafter must keep features of: step.draft in observe)
    greedy output still equals plain and eagle3 drafts some steps."""
    from specdraft.api import COST_POINTS, SpecDecoder

    dec = SpecDecoder(smol_f32)
    dec.set_cost_curves({n: 0.05 + 0.002 * (n - 1) for n in COST_POINTS})  # a flat CPU curve, not measured here
    sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    spec = SpecConfig.from_dict(
        {"method": "auto", "head": str(smol_eagle3[0] / "head"), "autotune": "off", "auto_arms": ["suffix", "eagle3"]}
    )
    p = GREEDY_PROMPTS[0]
    out = dec.generate(p, sampling=sp, spec=spec, chat=True)
    assert out.token_ids == smol_reference[p]
    arms = [s.arm for s in out.stats.steps]
    assert "eagle3" in arms and len(set(arms)) > 1, arms
