"""The OpenVINO backend (models/openvino.py) on Qwen2.5-Coder-0.5B as a Q4_0 GGUF (made by `specdraft
models quantize` once; OpenVINO GenAI cannot read this model's Q4_K_M file, and converts SmolLM2's Q4_1
file wrongly, which the backend refuses: test_a_wrong_conversion_is_refused): the conversion against the
dense copy, mechanics (chains, token trees through the attention-bias input, rollback as attention-mask
holes, compaction, rows), every drafter it runs greedy against plain decoding on the same backend (trees
included), lossless sampling end to end, and refusals.

Numerics: OpenVINO computes in bf16 where the CPU has it, quantizes activations to int8 for the 4-bit
matmuls and keeps an int8 KV cache, so an n-token feed and n single steps differ a little; a greedy
divergence is accepted only at a near-tie of plain decoding (backend_util.NEAR_TIE, each reported)."""

import pytest
import torch

from backend_util import (
    NEAR_TIE,
    check_conversation_after_hits,
    check_greedy,
    check_tree_nodes_and_accepted_path,
    check_wrong_attention_is_caught,
    exact_two_token_probs,
    plain_outputs,
    plain_tokens,
    pvalue,
    sample_pairs,
    single_steps,
)
from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.engine import Job, generate, generate_batch

pytest.importorskip("openvino", reason="the openvino backend needs openvino (make setup installs it)")
pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that reverses a linked list, then explain it.",
    "Summarize: the cat sat on the mat. The cat sat on the mat again, and then the cat slept.",
]
MODEL = "qwen2.5-coder-0.5b"
# the converted Q4_0 model against the dense float32 copy of the Q4_K_M file (teacher-forced, 33
# positions): requantizing to Q4_0, bf16 activations and int8 activation/KV quantization
DENSE_TOLERANCE = 8.0  # measured 5.5 (median 3.3); a wrong conversion (SmolLM2 Q4_1) is off by 10-20


@pytest.fixture(scope="module")
def smol_ov():
    """(the module's target; named like the other backends' small-model fixtures)"""
    from specdraft.core.errors import ModelFileError
    from specdraft.models import quantize
    from specdraft.models.backends import load_model

    try:
        quantize.variant_path(MODEL, "Q4_0")
    except ModelFileError:  # made once per machine (about 20 s), like the other model files
        quantize.quantize(MODEL, "Q4_0")

    return load_model(f"{MODEL}:Q4_0", backend="openvino")


@pytest.fixture(scope="module")
def dense(smol_ov):
    from specdraft.models.backends import load_model

    return load_model(MODEL, backend="hf", dtype="float32")


@pytest.fixture(scope="module")
def dec(smol_ov):
    from specdraft.api import SpecDecoder

    return SpecDecoder(smol_ov)


@pytest.fixture(scope="module")
def ids(dec):
    return [dec.encode(p, chat=True) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain_refs(dec, ids):
    return plain_outputs(dec, ids)


@pytest.fixture(scope="module")
def dec_with_draft(smol_ov):
    """The OpenVINO target with the same Q4_0 file on llama.cpp as the draft (two backends, close but not
    equal distributions: rejections happen; several times faster than the dense copy as a draft)."""
    from specdraft.api import SpecDecoder
    from specdraft.models.backends import load_model

    return SpecDecoder(smol_ov, load_model(f"{MODEL}:Q4_0", backend="llama"))


def test_facts(smol_ov):
    assert smol_ov.backend == "openvino" and smol_ov.vocab_size == 151936
    assert smol_ov.capabilities.trees and smol_ov.capabilities.hidden and smol_ov.capabilities.layers  # eagle3
    assert 151645 in smol_ov.eos_token_ids()  # <|im_end|>
    assert smol_ov.conversion["argmax_agree"] and smol_ov.conversion["median_diff"] < 4.0


def test_head_io_reads_the_gguf_file(smol_ov, dense):
    """facts, embed() and output_rows() read the GGUF file (gguf_tensors.py): the Q4_0 variant keeps the
    Q4_K_M file's metadata, so the facts equal the dense copy's config; its rows are the dense copy's
    requantized (cosine similarity per row measured 2026-12-05: 0.993 at least for the 4-bit embedding, 1.000
    for the LM head; the rows of the Q4_K_M file itself are bit-equal: tests/test_head_io.py)."""
    assert smol_ov.capabilities.head_io
    assert smol_ov.facts == dense.facts
    ids = torch.tensor([0, 13, 9707, 151643, 151645])
    with torch.no_grad():
        pairs = [(smol_ov.embed(ids), dense.embed(ids)), (smol_ov.output_rows(ids), dense.output_rows(ids))]
    for got, want in pairs:
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        print(f"cosine to the dense rows: min {float(cos.min()):.4f}")
        assert got.dtype == torch.float32 and float(cos.min()) > 0.98


def test_a_wrong_conversion_is_refused():
    """SmolLM2's Q4_1 file: OpenVINO's logits differ from llama.cpp's by about 10 at the median position."""
    from specdraft.core.errors import ModelFileError
    from specdraft.models.backends import load_model

    with pytest.raises(ModelFileError, match="OpenVINO converts smollm2-135m wrongly"):
        load_model("smollm2-135m", backend="openvino")


def test_a_file_with_tensor_types_openvino_cannot_read_is_one_clear_error():
    """Qwen2.5-Coder-0.5B's Q4_K_M file holds Q5_0 tensors, which OpenVINO GenAI's GGUF reader fails on deep
    inside ("Check 'data != nullptr' failed"): the loader says which types and how to make a copy it reads."""
    from specdraft.core.errors import ModelFileError
    from specdraft.models.backends import load_model

    with pytest.raises(
        ModelFileError,
        match=r"cannot read .*q4_k_m\.gguf: it holds Q5_0 tensors .*"
        r"models quantize qwen2.5-coder-0.5b --type Q4_0",
    ):
        load_model(MODEL, backend="openvino")


def test_conversion_matches_the_dense_model(smol_ov, dense, ids):
    """OpenVINO's logits over a prompt and 32 plain tokens against the dense float32 copy's (the same
    GGUF dequantized): the same argmax wherever the dense top-2 gap is not a near-tie, and every
    logit within DENSE_TOLERANCE."""
    p = ids[0]
    seq = p + plain_tokens(smol_ov, p, 32)
    rows = smol_ov.new_rows()
    rows.add_rows([p[:-1]])
    ov = rows.forward([seq[len(p) - 1 :]])[0]
    rows_d = dense.new_rows()
    rows_d.add_rows([p[:-1]])
    ref = rows_d.forward([seq[len(p) - 1 :]])[0].float()
    diff = (ov - ref).abs().max(-1).values
    print(f"max |openvino - dense float32| per position: median {diff.median():.3f}, max {diff.max():.3f}")
    assert diff.max() < DENSE_TOLERANCE
    top = ref.topk(2, -1).values
    clear = (top[:, 0] - top[:, 1]) > NEAR_TIE
    assert torch.equal(ov.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_rollback_holes_and_rows(smol_ov, ids):
    """Two rows: a chain of 8 scored at once matches single steps; commit keeps a prefix, truncate rolls
    back (both leave holes in the mask), trim compacts the state, and later logits stay those of plain
    decoding; a removed row leaves the other intact."""
    t = smol_ov
    ref = [plain_tokens(t, p, 10) for p in ids]
    rows = t.new_rows(compact_slack=2)
    rows.add_rows([p[:-1] for p in ids])
    lg = rows.forward([[p[-1]] + r[:7] for p, r in zip(ids, ref)])
    for i, (p, r) in enumerate(zip(ids, ref)):
        want = torch.stack(single_steps(t, p, r[:7]))
        assert (lg[i] - want).abs().max() < NEAR_TIE
    rows.commit([3, 8])
    rows.truncate(1, len(ids[1]) + 2)  # roll row 1 back to the same point as row 0
    assert rows.lens == [len(ids[0]) + 2, len(ids[1]) + 2] and rows.L > max(rows.lens)
    rows.trim()
    assert rows.L == max(rows.lens)
    lg = rows.forward([[ref[0][2], 5, 6], [ref[1][2], 7]])
    for i in range(2):
        want = single_steps(t, ids[i], ref[i][:3])[-1]
        assert (lg[i, 0] - want).abs().max() < NEAR_TIE and int(lg[i, 0].argmax()) == ref[i][3]
    rows.commit([1, 1])  # the wrong guesses 5, 6 and 7 become holes
    rows.remove_rows([0])
    lg = rows.forward([[ref[1][3]]])
    assert rows.B == 1 and int(lg[0, -1].argmax()) == ref[1][4]


def test_keep_returns_the_last_positions(smol_ov, ids):
    rows = smol_ov.new_rows()
    rows.add_rows([ids[0][:-1], ids[1][:-1]])
    feed = [[ids[0][-1], 5, 6, 7], [ids[1][-1], 9, 10]]
    full = rows.forward(feed)
    rows.commit([0, 0])
    last = rows.forward(feed, keep=2)
    assert last.shape[1] == 2
    assert (last[0] - full[0, 2:]).abs().max() < NEAR_TIE
    # columns count fed indices from N - keep: row 1's third token is column 0, nothing lands in column 1
    assert (last[1, 0] - full[1, 2]).abs().max() < NEAR_TIE and not last[1, 1].any()


SPECS = [
    {"method": "prompt_lookup", "schedule": "cost_aware"},
    {"method": "draft_model", "k": 4},
    {"method": "auto"},
    {"method": "suffix"},
    {"method": "draft_model", "tree": "static", "tree_branching": [2, 2, 1]},
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_every_drafter_greedy(dec_with_draft, ids, plain_refs, spec):
    d = dec_with_draft
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for p, ref in zip(ids, plain_refs):
        s = SpecConfig.from_dict(spec)
        out = generate(d.target, d.make_drafter(s), p, sp, length=d.draft_length(s))
        check_greedy(d.target, p, ref, out.token_ids, spec["method"])
        if spec["method"] == "draft_model" and "tree" not in spec:
            assert out.stats.acceptance_rate > 0.5
        if "tree" in spec or spec["method"] == "suffix":  # trees were scored, and paths of them accepted
            assert any(st.depth is not None for st in out.stats.steps) and out.stats.accepted > 0


def test_batch_rows_equal_plain(dec, ids, plain_refs):
    sp = SamplingParams(max_new_tokens=32, ignore_eos=True)
    specs = [SpecConfig(method="prompt_lookup"), SpecConfig(method="plain")]
    jobs = [Job(p, sp, dec.make_drafter(s)) for p in ids for s in specs]
    together = generate_batch(dec.target, jobs, eos_ids=set(), max_batch=3, join_every=2)
    refs = [ref[: sp.max_new_tokens] for ref in plain_refs for _ in specs]
    for job, s, ref, res in zip(jobs, specs * len(ids), refs, together):
        check_greedy(dec.target, job.prompt_ids, ref, res.token_ids, f"batch {s.method}")


@pytest.mark.long
def test_sampling_end_to_end(dec_with_draft):
    """The first two tokens of seeded requests (top-k 3, T=1) follow the target's exact distribution
    with a draft model (rejections happen); plain decoding at T=0.3 fails the same test. (Verification
    is the same tensor function on every backend: sampled trees are tested on transformers, and this
    backend's tree logits by the greedy tree runs and test_wrong_attention_is_caught, which keeps this
    file's time down; a request costs ~0.3 s here, mostly its prefill.)"""
    d = dec_with_draft
    prompt = d.encode("Name a colour: red, green, blue, red, green,", chat=False)
    sp = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=2)
    probs = exact_two_token_probs(d.target, prompt, 3)
    spec = SpecConfig(method="draft_model", k=2)
    p = pvalue(sample_pairs(d.target, lambda: d.make_drafter(spec), prompt, sp, 100), probs)
    assert p > 1e-3, f"draft_model: p = {p:.2e}"
    cold = SamplingParams(temperature=0.3, top_k=3, max_new_tokens=2)
    plain = lambda: d.make_drafter(SpecConfig(method="plain"))  # noqa: E731
    assert pvalue(sample_pairs(d.target, plain, prompt, cold, 60), probs) < 1e-3


def test_tree_nodes_and_accepted_path(smol_ov, ids):
    check_tree_nodes_and_accepted_path(smol_ov, ids[0])


def test_wrong_attention_is_caught(smol_ov, ids):
    check_wrong_attention_is_caught(smol_ov, ids[0])


def test_refused_methods(dec_with_draft):
    from specdraft.core.errors import ConfigError

    for m in ["medusa", "eagle"]:
        with pytest.raises(ConfigError, match=f"method '{m}' is not available on the openvino backend"):
            dec_with_draft.make_drafter(SpecConfig.from_dict({"method": m, "head": "x"}))


@pytest.mark.long
def test_bench_with_openvino_genai_baselines(smol_ov, tmp_path):
    """The bench on this backend, with OpenVINO GenAI's own plain decoding of the same IR as the
    baseline: every runner produced tokens (the lookup and draft runners differ only in the pipeline's
    options, measured in docs/benchmark-log.md)."""
    import json

    from specdraft.cli import main

    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Repeat: a b c d a b c d a b"]}) + "\n")
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "bench",
                "--backend",
                "openvino",
                "--target",
                f"{MODEL}:Q4_0",
                "--dataset",
                str(data),
                "--max-new-tokens",
                "8",
                "--methods",
                "plain,prompt_lookup,ov_genai",
                "--reference",
                "ov_genai",
                "--no-plots",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert not doc["skipped"], doc["skipped"]
    got = {r["method"]: r for r in doc["records"]}
    assert set(got) == {"plain", "prompt_lookup", "ov_genai"}
    assert all(r["new_tokens"] > 0 for r in got.values())


def test_conversation_turns_start_from_cached_prefixes(smol_ov):
    """OpenVINO: a later turn's infer request gets the cached state tensors and prefills the rest; its greedy
    output is a cold run's, or parts at a near-tie (prefill chunks change OpenVINO's numerics)."""
    check_conversation_after_hits(smol_ov, {"method": "prompt_lookup"}, "openvino prompt_lookup")
