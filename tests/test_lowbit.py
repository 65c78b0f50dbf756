"""Weight-only int8 / int4 linear layers (models/lowbit.py): the kernels compute x W^T with the
dequantized W; a quantized copy of the target drafts losslessly (the dense target verifies); a
quantized target is its own model, equal to its own plain decoding; bad names are clear errors."""

import copy

import pytest
import torch
from torch import nn

from conftest import logits_of, tiny_llama
from specdraft.api import SpecDecoder
from specdraft.bench.harness import compare
from specdraft.cli import main
from specdraft.core.errors import ConfigError
from specdraft.core.metrics import near_tie_bound
from specdraft.models.hf import HFModel
from specdraft.models.lowbit import Int4Linear, Int8Linear, W8A8Linear, parse_quant, quantize_linears


@pytest.mark.parametrize("rows", [5, 600])  # 600: a prefill, through the dequantized weight (DEQUANTIZE_FROM)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int8", "int4-g32", "int4-g64", "w8a8"])
def test_kernel_matches_dequantized_weight(kind, dtype, rows):
    torch.manual_seed(0)
    lin = nn.Linear(128, 96, bias=True).to(dtype)
    bits, group, dynamic = parse_quant(kind)
    q = W8A8Linear(lin) if dynamic else Int8Linear(lin) if bits == 8 else Int4Linear(lin, group)
    x = torch.randn(2, rows, 128, dtype=dtype)
    want = x.float() @ q.weight.float().t() + lin.bias.float()
    got = q(x).float()
    # w8a8 rounds each input row to 255 levels too: about 1% of the output's scale
    tol = 0.1 if dtype == torch.bfloat16 else 2e-2 if dynamic else 2e-3
    assert got.shape == (2, rows, 96) and (got - want).abs().max() < tol * want.abs().max()
    # and the quantization error itself is bounded: half a step of the grid
    step = lin.weight.float().abs().amax(1, keepdim=True) / q.levels if bits == 8 else None
    if step is not None:
        assert ((q.weight.float() - lin.weight.float()).abs() <= step / 2 + 1e-2 * step + 1e-3).all()


def test_parse_quant():
    assert parse_quant("int8") == (8, 0, False) and parse_quant("int4") == (4, 128, False)
    assert parse_quant("int4-g64") == (4, 64, False) and parse_quant("w8a8") == (8, 0, True)
    for bad in ("int3", "int8-g64", "int4-g48", "q4", ""):
        with pytest.raises(ConfigError):
            parse_quant(bad)


def quantized(model: HFModel, kind: str, layers: int = 2 * 7 + 1) -> HFModel:
    m = copy.deepcopy(model.model)
    info = quantize_linears(m, kind)
    assert info["layers"] == layers  # q k v o gate up down per layer, and the LM head
    q = HFModel(m, None, name=f"{model.name}:{kind}")
    q.quantization = info
    return q


def test_prefill_uses_the_targets_dense_layers():
    """A self-draft quantized with dense_from=target prefills with the target's own dense layers (its
    prompt logits are the target's), and drafts single tokens with the low-bit kernels."""
    t = tiny_llama(vocab=64, hidden=64)
    m = copy.deepcopy(t.model)
    info = quantize_linears(m, "int4-g32", dense_from=t.model)
    assert info["shares_dense_prefill"]
    ids = torch.arange(20)[None] % 64
    with torch.no_grad():
        assert torch.equal(m(ids).logits, t.model(ids).logits)  # 20 rows >= SHARED_DENSE_FROM
        assert not torch.equal(m(ids[:, :3]).logits, t.model(ids[:, :3]).logits)


@pytest.mark.parametrize("kind", ["int8", "int4-g32"])
def test_quantized_self_draft_is_lossless(kind):
    """Greedy and T=1 seeded: the dense target with its own quantized copy drafting gives the dense
    target's tokens; the copy drafts well (the copy is close to the target)."""
    t = tiny_llama(vocab=64, hidden=64)
    dec = SpecDecoder(t, quantized(t, kind))
    ids = [1, 5, 9, 3, 7]
    for sp in (
        {"max_new_tokens": 40, "ignore_eos": True},
        {"max_new_tokens": 40, "ignore_eos": True, "temperature": 1.0, "seed": 3},
    ):
        plain = dec.generate(ids, sampling=sp, spec={"method": "plain"})
        spec = dec.generate(ids, sampling=sp, spec={"method": "draft_model", "k": 4})
        if "temperature" not in sp:
            assert spec.token_ids == plain.token_ids
        steps = spec.stats.steps
        assert sum(s.accepted for s in steps) / sum(s.drafted for s in steps) > 0.5


def self_draft(t: HFModel, kind: str) -> HFModel:
    """What --draft self:int4 builds (api._self_draft), on a tiny model: prefills through t's dense layers."""
    m = copy.deepcopy(t.model)
    quantize_linears(m, kind, dense_from=t.model)
    d = HFModel(m, None, name=f"{t.name}:{kind}")
    d.prefill_twin = t
    return d


def test_a_self_draft_starts_from_the_targets_prefill():
    """The draft's cache of a prompt is a copy of the target's (rows of a batch, left-padded): the draft
    then scores as it would after its own prefill, never feeds the prompt itself, and greedy output is
    the dense target's."""
    t = tiny_llama(vocab=64, hidden=64)
    d = self_draft(t, "int4-g32")
    prompts = [[(3 * i + 1) % 64 for i in range(30)], [(5 * i + 2) % 64 for i in range(21)]]
    src = t.new_rows()
    src.add_rows(prompts)
    adopted, own = d.new_rows(), d.new_rows()
    adopted.adopt_rows(src, [1, 0])
    own.add_rows(prompts[::-1])
    assert adopted.lens == own.lens == [21, 30]
    nxt = [[7, 8], [9, 10]]
    assert torch.allclose(adopted.forward(nxt), own.forward(nxt), atol=1e-5)

    fed = []
    forward = d.model.forward
    d.model.forward = lambda *a, **k: (
        fed.append((k.get("input_ids", a[0] if a else None)).shape[-1]) or forward(*a, **k)
    )
    dec = SpecDecoder(t, d)
    sp = {"max_new_tokens": 24, "ignore_eos": True}
    plain = dec.generate(prompts[0], sampling=sp, spec={"method": "plain"}).token_ids
    out = dec.generate(prompts[0], sampling=sp, spec={"method": "draft_model", "k": 4})
    assert out.token_ids == plain and out.stats.accepted > 0
    assert fed and max(fed) <= 4 + 1, fed  # catch-up feeds only, never the 30-token prompt


def test_quantized_target_equals_its_own_plain():
    t = quantized(tiny_llama(vocab=64, hidden=64), "int4-g32")
    dec = SpecDecoder(t, tiny_llama(vocab=64, hidden=64))
    ids = [2, 4, 6, 2, 4]
    sp = {"max_new_tokens": 30, "ignore_eos": True}
    plain = dec.generate(ids, sampling=sp, spec={"method": "plain"}).token_ids
    for spec in ({"method": "draft_model", "k": 3}, {"method": "prompt_lookup"}):
        assert dec.generate(ids, sampling=sp, spec=spec).token_ids == plain


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["generate", "x", "--quantize", "int3"], "error: unknown weight quantization 'int3' on the hf backend"),
        (["generate", "x", "--quantize", "int8", "--backend", "llama"], "error: --quantize is for the hf backend"),
        (["costs", "--quantizations", "int4-g7"], "error: the int4 group size must be one of 32, 64, 128, 256, got 7"),
    ],
)
def test_quantize_argument_errors(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(msg) and err.count("\n") == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_sibling_groups_are_one_matmul_with_the_same_product(dtype):
    """q/k/v and gate/up read one input: fused into one W8A8Linear each, the model's logits are bit for
    bit those of the separate layers (each output column has its own weight scale, each row its own
    activation scale, products in int32), and its input is left untouched."""
    torch.manual_seed(0)
    base = tiny_llama(vocab=64).model.to(dtype)
    fused, separate = copy.deepcopy(base), copy.deepcopy(base)
    assert quantize_linears(fused, "w8a8")["layers"] == quantize_linears(separate, "w8a8", fuse=False)["layers"]
    attn = fused.model.layers[0].self_attn
    assert attn.q_proj.fused[0] is attn.k_proj.fused[0] is attn.v_proj.fused[0]
    ids = torch.randint(0, base.config.vocab_size, (2, 7))
    with torch.inference_mode():
        assert torch.equal(fused(input_ids=ids).logits, separate(input_ids=ids).logits)
    x = torch.randn(3, attn.q_proj.in_features, dtype=dtype)
    keep = x.clone()
    q, k = attn.q_proj(x), attn.k_proj(x)
    assert torch.equal(x, keep) and q.shape[-1] == attn.q_proj.out_features and k.shape[-1] == attn.k_proj.out_features


def test_w8a8_rows_do_not_depend_on_the_batch():
    """Each row is quantized with its own scale and multiplied in int32: a row's output is the same
    alone or among 16 others (what makes scoring k tokens agree with scoring them one at a time)."""
    torch.manual_seed(0)
    q = W8A8Linear(nn.Linear(256, 96, bias=False))
    x = torch.randn(16, 256) * torch.logspace(-2, 2, 16)[:, None]  # rows of very different scales
    alone = torch.cat([q(x[i : i + 1]) for i in range(16)])
    assert torch.equal(q(x), alone)


@pytest.mark.parametrize("text", ["def fibonacci(n):\n    ", "The capital of France is"])
def test_w8a8_target_agrees_with_its_own_plain_on_smollm2(smol_f32, text):
    """SmolLM2-135M with w8a8 linear layers in float32, drafted and verified (chains of 5 tokens, and
    prompt lookup): its own plain greedy tokens up to near-ties. Scoring 5 tokens instead of 1 moves
    attention's float32 sums by a last bit, which int8 activations can round to the next step, so a
    divergence is allowed only where plain's top-2 logit gap is under near_tie_bound (as on llama.cpp)."""
    t = quantized(smol_f32, "w8a8", layers=30 * 7 + 1)
    dec = SpecDecoder(t, smol_f32)
    ids = smol_f32.tokenizer(text).input_ids
    sp = {"max_new_tokens": 32, "ignore_eos": True}
    plain = dec.generate(ids, sampling=sp, spec={"method": "plain"}).token_ids
    for spec in ({"method": "draft_model", "k": 5}, {"method": "prompt_lookup"}):
        got = dec.generate(ids, sampling=sp, spec=spec).token_ids
        d = compare(t, ids, plain, got)
        assert d["exact"] or d["top2_gap"] < near_tie_bound(t), d
    dense = SpecDecoder(smol_f32, None).generate(ids, sampling=sp, spec={"method": "plain"}).token_ids
    # a different model, but a close one: teacher-forced on the dense model's answer, it mostly agrees
    # (on CPUs without VNNI its weights take 7 bits, lowbit.w8a8_weight_levels, so a token may differ early)
    pred = logits_of(t, ids + dense[:-1], keep=len(dense)).argmax(-1).tolist()
    assert sum(a == b for a, b in zip(pred, dense)) >= 0.75 * len(dense)
