"""The benchmark's two measures, each over its own fastest plain decoder: the decode phase (the tokens
after the first over the seconds after the first) and end to end; every runner reports its first token."""

import time
import types

import pytest

from conftest import tiny_llama
from specdraft.api import SpecDecoder
from specdraft.bench import runners
from specdraft.bench.report import aggregate, headline, markdown
from specdraft.core.config import SamplingParams, SpecConfig

# (wall s, first-token s) per record, 11 new tokens each: decode tok/s = 10 / (wall - first)
TIMES = {
    "llama_cpp": (3.0, 2.0),
    "ov_genai": (2.5, 1.0),
    "plain": (3.1, 2.0),
    "auto": (2.8, 2.0),
    "openvino:suffix_k16": (2.2, 1.0),
}


def synthetic_doc(first_token: bool = True) -> dict:
    recs = []
    for pid, task in (("a", "qa"), ("b", "code_edit")):
        for m, (wall, first) in TIMES.items():
            r = {
                "prompt_id": pid,
                "task": task,
                "method": m,
                "repeat": 0,
                "new_tokens": 11,
                "wall_s": wall,
                **({"first_token_s": first} if first_token else {}),
            }
            if m in ("auto", "openvino:suffix_k16"):
                r["exact"] = not (m == "openvino:suffix_k16" and pid == "b")
                r.update({"first_divergence": 3, "top2_gap": 0.01} if not r["exact"] else {})
            recs.append(r)
    return {
        "settings": {
            "reference": "fastest_plain",
            "target": "t",
            "backend": "llama",
            "dtype": "bfloat16",
            "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 11},
            "methods": {
                "plain": {"method": "plain"},
                "auto": {"method": "auto"},
                "openvino:suffix_k16": {"method": "suffix"},
                "llama_cpp": {"baseline": "llama_cpp"},
                "ov_genai": {"baseline": "ov_genai"},
            },
        },
        "environment": {"cpu": "Test CPU (AVX-512)", "date": "2026-12-05T01:02:03+00:00"},
        "records": recs,
    }


def test_decode_phase_and_end_to_end_each_over_their_own_fastest_plain_decoder():
    doc = synthetic_doc()
    agg = aggregate(doc)
    # decode phase: llama_cpp 10 / 1.0 s = 10 tok/s beats ov_genai's 10 / 1.5 s; end to end ov_genai's 11 / 2.5 s wins
    assert agg["decode_reference"] == "llama_cpp" and agg["reference"] == "ov_genai"
    rows = agg["rows"]
    assert rows["auto"]["decode_tokens_per_s"] == pytest.approx(12.5)
    assert rows["auto"]["decode_speedup"] == pytest.approx(1.25)  # 12.5 / 10
    assert rows["auto"]["speedup"] == pytest.approx((11 / 2.8) / (11 / 2.5))
    assert rows["openvino:suffix_k16"]["decode_speedup"] == pytest.approx((10 / 1.2) / 10)
    assert rows["openvino:suffix_k16"]["speedup"] == pytest.approx(2.5 / 2.2)
    assert rows["auto"]["task_decode_speedup"] == {"qa": pytest.approx(1.25), "code_edit": pytest.approx(1.25)}
    assert rows["ov_genai"]["first_token_s"] == pytest.approx(1.0)
    row = headline(doc, agg)
    assert (
        "| Test CPU (AVX-512), 2026-12-05 | 2 prompts x 11 new tokens, greedy "
        "| llama_cpp 10.00, auto 12.50 tok/s | **1.25x** "
        "| ov_genai 4.40, openvino:suffix_k16 5.00 tok/s | **1.14x** "
        "| auto 2/2 identical; openvino:suffix_k16 1/2 identical, divergences at top-2 gaps <= 0.010 |"
    ) in row
    md = markdown(doc, agg)
    assert (
        "Decode phase (the tokens after the first" in md and "| auto | 1.25x | 1.25x | **1.25x** | 12.50 | 2.00 |" in md
    )


def test_results_without_first_token_times_report_end_to_end_only():
    doc = synthetic_doc(first_token=False)
    agg = aggregate(doc)
    assert agg["decode_reference"] is None and agg["rows"]["auto"]["decode_speedup"] is None
    assert "| - | - | ov_genai 4.40, openvino:suffix_k16 5.00 tok/s | **1.14x** |" in headline(doc, agg)
    assert "Decode phase" not in markdown(doc, agg)


# --- every runner's first token -----------------------------------------------------------------------
FIRST, EACH, N = 0.05, 0.01, 5  # a fake call: its first token after FIRST s, then one every EACH s


class _FakeLlama:
    """llama-cpp-python's Llama as LlamaCppRunner uses it."""

    def reset(self):
        pass

    def generate(self, ids, **kw):
        time.sleep(FIRST)
        for i in range(100):
            if i:
                time.sleep(EACH)
            yield 3


class _FakeGenAI:
    """openvino_genai as OVGenAIRunner uses it: a pipeline that streams N tokens."""

    StreamingStatus = types.SimpleNamespace(RUNNING=0)

    class StreamerBase:
        pass

    class GenerationConfig:
        pass

    @staticmethod
    def TokenizedInputs(ids, mask):
        return ids


class _FakePipe:
    def generate(self, inputs, config, streamer=None):
        time.sleep(FIRST)
        for i in range(config.max_new_tokens):
            if i:
                time.sleep(EACH)
            if streamer is not None:
                streamer.write(3)
        return types.SimpleNamespace(tokens=[[3] * config.max_new_tokens])


def _engine(dec):
    return runners.EngineRunner("plain", dec, SpecConfig(method="plain"))


def _hf(dec):
    return runners.HFRunner("hf_generate", dec, "plain")


def _llama_cpp(dec):
    r = object.__new__(runners.LlamaCppRunner)  # its __init__ loads a GGUF file
    r.name, r.eos_ids, r.llm = "llama_cpp", set(), _FakeLlama()
    return r


def _ov_genai(dec):
    pytest.importorskip("openvino")
    r = object.__new__(runners.OVGenAIRunner)  # its __init__ loads an IR
    r.name, r.eos_ids, r.mode, r.k, r.genai, r.pipe = "ov_genai", set(), "plain", 4, _FakeGenAI, _FakePipe()
    return r


MAKE = {
    runners.EngineRunner: _engine,
    runners.HFRunner: _hf,
    runners.LlamaCppRunner: _llama_cpp,
    runners.OVGenAIRunner: _ov_genai,
}


def test_every_runner_reports_its_first_token_time():
    """Each kind of runner the bench makes (runners.RUNNERS: a new one needs its fake here) reports
    first_token_s on the same clock as wall_s; the fakes' first token comes after FIRST seconds, then one
    every EACH seconds, so the decode phase is what follows."""
    assert set(MAKE) == set(runners.RUNNERS), "a runner without a fake here: add one"
    dec = SpecDecoder(tiny_llama(vocab=16))
    sp = SamplingParams(max_new_tokens=N)
    for kind, make in MAKE.items():
        rec = make(dec).run([1, 2, 3], sp)
        assert len(rec["token_ids"]) == N, kind
        assert 0 < rec["first_token_s"] < rec["wall_s"], (kind, rec["first_token_s"], rec["wall_s"])
        if kind in (runners.LlamaCppRunner, runners.OVGenAIRunner):  # the fakes' own pace
            # 2 ms of slack: the runner's clock starts a fraction of a millisecond after a fake call began sleeping
            assert rec["first_token_s"] >= FIRST - 0.002, kind
            assert rec["wall_s"] - rec["first_token_s"] >= (N - 1) * EACH, kind
