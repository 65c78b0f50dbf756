"""What a trained head reads from a target on every backend (models/base.py, ``Capabilities.head_io`` and
``layers``): the architecture facts, the input embedding and LM head rows of a GGUF file (gguf_tensors.py,
shared by llama.cpp and OpenVINO) against the dense copy transformers made of the same file, and llama.cpp's
decoder-layer outputs (llama_features.py) in batched decodes against one prefill and against the dense model.

Tolerances, measured 2026-12-05 on an AMD EPYC (Zen 4, 2 vCPUs, shared with other jobs), SmolLM2-135M Q4_1:
- embed / output_rows: bit-equal to the dense copy (both dequantize the same blocks with gguf's function);
- layer outputs of 1-token steps of 3 rows against one prefill of the same tokens: bit-equal here (flash
  attention on, as llama.py sets it), but llama.cpp's n-token and 1-token kernels may differ: on
  Qwen2.5-Coder-1.5B Q4_K_M the largest error was 1.0% of a layer's largest magnitude (LAYER_NOISE allows
  2%), while the same tokens after another prefix are off by 22-28%;
- against the dense float32 model: Q4_1 quantization noise, cosine similarity per position >= DENSE_COSINE.
"""

import pytest
import torch

from specdraft.core.errors import ConfigError

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
H = 576
LAYERS = [2, 15, 30]  # hidden-states indices: early, middle and the last decoder layer (a case of its own)
LAYER_NOISE = 0.02  # of a layer's largest magnitude (module doc)
DENSE_COSINE = 0.99  # measured: see the module doc
TEXT = (
    "def fibonacci(n):\n    # the n-th Fibonacci number\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b"
)


@pytest.fixture(scope="module")
def ids(smol_f32):
    return smol_f32.tokenizer(TEXT, add_special_tokens=False)["input_ids"]


def llama_model(monkeypatch=None, **consts):
    """A SmolLM2 GGUF model of its own on llama.cpp (its feature layers must not leak into the session's
    smol_gguf), its contexts made under ``consts`` (llama.py's N_BATCH, N_UBATCH, MAX_SEQ)."""
    from specdraft.models import llama
    from specdraft.models.backends import load_model

    for k, v in consts.items():
        monkeypatch.setattr(llama, k, v)
    return load_model(MODEL, backend="llama")


@pytest.fixture(scope="module")
def tapped():
    m = llama_model()
    assert m.add_feature_layers(LAYERS) == [0, 1, 2]  # no final-norm block on llama.cpp
    return m


def test_facts_agree_across_backends(smol_f32, smol_gguf):
    """One GGUF reader for llama.cpp and OpenVINO (OpenVINO refuses SmolLM2's Q4_1 conversion, so its class
    is checked on the file without compiling): every field equals the dense copy's config."""
    from specdraft.models.openvino import OVModel

    ov = object.__new__(OVModel)
    ov.gguf = smol_gguf.gguf
    assert smol_gguf.capabilities.head_io and OVModel.capabilities.head_io
    assert smol_gguf.facts == smol_f32.facts == ov.facts
    assert smol_gguf.facts.vocab_size == smol_gguf.vocab_size


def test_embed_and_output_rows_equal_the_dense_copy(smol_f32, smol_gguf):
    """The dense copy was dequantized from this file by transformers with the same function: bit-equal.
    SmolLM2 ties its LM head to the embedding (no output.weight): output_rows reads token_embd."""
    ids = torch.tensor([[0, 1, 17, 49151], [500, 12345, 2, 3]])
    e = smol_gguf.embed(ids)
    assert e.shape == (2, 4, H) and e.dtype == torch.float32
    assert torch.equal(e, smol_f32.embed(ids))
    assert torch.equal(smol_gguf.output_rows(ids[0]), smol_f32.output_rows(ids[0]))
    assert torch.equal(smol_gguf.output_rows(), smol_f32.output_rows())
    with pytest.raises(IndexError):
        smol_gguf.embed(torch.tensor([49152]))


def steps_features(model, seqs: list[list[int]], start: list[int]) -> list[torch.Tensor]:
    """Each row's features of seqs[r][start[r]:] fed one token per forward, all rows in each decode (rows
    whose tokens ran out feed nothing); the prefixes seqs[r][:start[r]] prefilled together."""
    rows = model.new_rows()
    rows.add_rows([s[:n] for s, n in zip(seqs, start)])
    got = [[] for _ in seqs]
    for k in range(max(len(s) - n for s, n in zip(seqs, start))):
        feed = [[s[n + k]] if n + k < len(s) else [] for s, n in zip(seqs, start)]
        rows.forward(feed, hidden=True)
        for r, f in enumerate(feed):
            if f:
                got[r].append(rows.last_hidden[r, 0])
        rows.commit([len(f) for f in feed])
    return [torch.stack(g) for g in got]


def prefill_features(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    rows = model.new_rows()
    rows.add_rows(seqs, hidden=True)
    return rows.prefill_hidden


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest error of ``a`` against ``b`` relative to b's largest magnitude, the worst layer block (the
    layers' scales differ by 100x)."""
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a.split(H, -1), b.split(H, -1)))


def test_batched_steps_match_one_prefill(tapped, ids):
    """Three rows of different lengths stepped together (one decode per step, ragged ends) hand over what
    a prefill of each row's tokens does, row by row and position by position."""
    seqs = [ids[:14], ids[3:25], ids[:9]]
    start = [6, 12, 2]
    stepped = steps_features(tapped, seqs, start)
    whole = prefill_features(tapped, seqs)
    for r, (s, n) in enumerate(zip(seqs, start)):
        assert whole[r].shape == (len(s), 3 * H)
        err = rel_err(stepped[r], whole[r][n:])
        print(f"row {r}: largest error {err:.2e} of the features' scale")
        assert err < LAYER_NOISE, f"row {r}"
    wrong = rel_err(stepped[0], whole[1][3:11])  # the check has power: the same tokens after another prefix
    print(f"the same tokens after another prefix: {wrong:.2f}")
    assert wrong > 5 * LAYER_NOISE


def test_ragged_feed_places_each_row(tapped, ids):
    """One forward feeding rows 2, 0 and 3 tokens: row r's fed token i lands at last_hidden[r, i], zeros
    beyond, as in a prefill of the row's tokens; a feed of nothing and an empty prefix."""
    seqs = [ids[:8], ids[:5], ids[4:15]]
    rows = tapped.new_rows()
    rows.add_rows([seqs[0][:6], seqs[1], seqs[2][:8]])
    rows.forward([seqs[0][6:8], [], seqs[2][8:11]], hidden=True)
    got = rows.last_hidden
    assert got.shape == (3, 3, 3 * H)
    whole = prefill_features(tapped, [seqs[0], seqs[2][:11]])
    assert rel_err(got[0, :2], whole[0][6:8]) < LAYER_NOISE and not got[0, 2].any()
    assert not got[1].any()
    assert rel_err(got[2], whole[1][8:11]) < LAYER_NOISE
    rows.commit([2, 0, 3])
    rows.forward([[], [], []], hidden=True)  # nothing fed: zeros of the full width
    assert rows.last_hidden.shape == (3, 1, 3 * H) and not rows.last_hidden.any()
    rows.add_rows([[], seqs[1]], hidden=True)  # an empty prefix has no features
    assert rows.prefill_hidden[0] is None
    assert rel_err(rows.prefill_hidden[1], prefill_features(tapped, [seqs[1]])[0]) < LAYER_NOISE


def test_layers_match_the_dense_model(tapped, smol_f32, ids):
    """The Q4_1 model's layer outputs against the dense copy's (transformers' output_hidden_states, whose
    last entry is the final norm's output: the last layer is compared with the dense model's own hook on
    that layer instead): quantization noise only."""
    got = prefill_features(tapped, [ids])[0]
    with torch.no_grad():
        hs = smol_f32.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        seen = []
        hook = smol_f32.model.model.layers[-1].register_forward_hook(
            lambda m, i, o: seen.append(o[0] if isinstance(o, tuple) else o)
        )
        try:
            smol_f32.model(torch.tensor([ids]))
        finally:
            hook.remove()
    last = seen[0][0]
    for b, i in enumerate(LAYERS):
        ref = hs[i][0] if i < len(hs) - 1 else last
        cos = torch.nn.functional.cosine_similarity(got[:, b * H : (b + 1) * H], ref, dim=-1)
        print(f"layer output {i}: cosine min {float(cos.min()):.5f}, median {float(cos.median()):.5f}")
        assert float(cos.min()) > DENSE_COSINE, f"layer output {i}"


def test_long_prefill_and_small_micro_batches_keep_order(monkeypatch, tapped, ids):
    """A prefill longer than N_BATCH takes several decodes, and a decode of more than N_UBATCH tokens
    several graph evaluations: the features come out in the fed order all the same."""
    seqs = [ids[:20], ids[5:31]]
    want = prefill_features(tapped, seqs)
    small = llama_model(monkeypatch, N_BATCH=8, N_UBATCH=3, MAX_SEQ=8)  # llama.cpp: sequences <= batch
    small.add_feature_layers(LAYERS)
    got = prefill_features(small, seqs)
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel_err(g, w) < LAYER_NOISE
    rows = small.new_rows()
    rows.add_rows([seqs[0][:4], seqs[1][:2]])
    rows.forward([seqs[0][4:], seqs[1][2:]], hidden=True)  # a catch-up feed of 16 + 24 tokens
    assert rel_err(rows.last_hidden[0, :16], want[0][4:]) < LAYER_NOISE
    assert rel_err(rows.last_hidden[1], want[1][2:]) < LAYER_NOISE


def test_the_tap_changes_no_logits(tapped, smol_gguf, ids):
    """Verification reads these logits: a tapped context's, features or not, equal a plain context's."""
    plain = smol_gguf.new_rows()
    assert plain.tap is None  # plain decoding pays nothing: no callback on its contexts
    plain.add_rows([ids[:10]])
    want = plain.forward([ids[10:16]])
    rows = tapped.new_rows()
    rows.add_rows([ids[:10]], hidden=True)
    assert torch.equal(rows.forward([ids[10:16]], hidden=True), want)
    rows.commit([0])
    assert torch.equal(rows.forward([ids[10:16]], keep=2), want[:, -2:])


def test_hidden_needs_feature_layers():
    """hidden=True with no layers added (llama.cpp has no final-norm block), or on rows made before the
    layers were added, is one clear ConfigError; so is a layer the model does not have."""
    m = llama_model()
    rows = m.new_rows()
    with pytest.raises(ConfigError, match="add_feature_layers"):
        rows.add_rows([[1, 2, 3]], hidden=True)
    rows.add_rows([[1, 2, 3]])
    with pytest.raises(ConfigError, match="add_feature_layers"):
        rows.forward([[4]], hidden=True)
    m.add_feature_layers([3])
    with pytest.raises(ConfigError, match="made before add_feature_layers"):
        rows.forward([[4]], hidden=True)
    assert rows.lens == [3] and rows.forward([[4]]).shape == (1, 1, 49152)  # the failed calls left nothing
    for bad in ([0], [31]):
        with pytest.raises(ConfigError, match="no decoder layer output"):
            m.add_feature_layers(bad)
