"""The benchmark harness end to end on a tiny model (seconds): run, resume, report, plots."""

import json

import pytest
import torch

from conftest import tiny_llama, tiny_model_dir
from specdraft.bench import runners
from specdraft.bench.report import aggregate
from specdraft.cli import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture()
def dataset(tmp_path):
    p = tmp_path / "q.jsonl"
    rows = [
        {"question_id": i, "category": c, "turns": [f"Say {c} number {i}. Say {c} number {i}."]}
        for i, c in enumerate(["summarization", "summarization", "qa", "writing"])
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def _args(tiny_dir, dataset, out, *extra):
    return [
        "bench",
        "--target",
        str(tiny_dir),
        "--draft",
        str(tiny_dir),
        "--draft-layers",
        "1",
        "--dtype",
        "float32",
        "--dataset",
        str(dataset),
        "--max-new-tokens",
        "8",
        "--methods",
        "plain,draft_model,prompt_lookup,hf_generate,llama_cpp",
        "--sweep",
        "k=1,3",
        "--out",
        str(out),
        *extra,
    ]


def test_bench_end_to_end_resume_and_report(tiny_dir, dataset, tmp_path, monkeypatch, capsys):
    out = tmp_path / "r.json"
    # interrupt after 5 records: a valid partial file remains
    calls = {"n": 0}
    orig = runners.EngineRunner.run

    def flaky(self, ids, sp):
        calls["n"] += 1
        if calls["n"] == 5 + 5:  # 5 warm-up runs first
            raise KeyboardInterrupt
        return orig(self, ids, sp)

    monkeypatch.setattr(runners.EngineRunner, "run", flaky)
    assert main(_args(tiny_dir, dataset, out)) == 130
    partial = json.loads(out.read_text())
    assert 0 < len(partial["records"]) < 4 * 6
    monkeypatch.setattr(runners.EngineRunner, "run", orig)
    assert main(_args(tiny_dir, dataset, out)) == 0
    doc = json.loads(out.read_text())
    keys = [(r["prompt_id"], r["method"], r["repeat"]) for r in doc["records"]]
    assert len(keys) == len(set(keys)) == 4 * 6  # 4 prompts x (plain, 2 draft_model, 2 prompt_lookup, hf)
    assert "llama_cpp" in doc["skipped"] or any(r["method"] == "llama_cpp" for r in doc["records"])
    for r in doc["records"]:
        assert r["new_tokens"] == len(r["token_ids"]) and r["wall_s"] > 0
        assert r["decode_tokens"] == r["new_tokens"] - 1 and r["decode_s"] == pytest.approx(
            r["wall_s"] - r["first_token_s"]
        )
        if r["method"] in ("plain", "draft_model", "prompt_lookup"):  # the engine's runs: their prefill apart
            assert 0 < r["prefill_s"] < r["wall_s"]
        if r["method"] != "plain":
            assert r["exact"] is True  # greedy: every method reproduces plain decoding
    env = doc["environment"]
    for k in ("torch", "transformers", "cpu", "threads", "dtype", "git_commit", "date"):
        assert k in env
    agg = aggregate(doc)
    assert agg["rows"]["plain"]["speedup"] == 1.0
    assert set(agg["tasks"]) == {"summarization", "qa", "mt_bench"}
    capsys.readouterr()
    # re-render without rerunning
    for f in tmp_path.glob("r_*"):
        f.unlink()
    assert main(["bench", "report", str(out)]) == 0
    cap = capsys.readouterr()
    md = cap.out
    assert "| method | mt_bench | summarization | qa | Overall | MAT | tok/s |" in md
    # it ends by naming where everything is
    assert f"report: {tmp_path / 'r_report.md'}" in cap.err and f"{tmp_path / 'r_speedup.png'}" in cap.err
    assert "draft_model[k=3]" in md and "hf_generate" in md
    for suffix in ("_report.md", "_speedup.png", "_acceptance.png", "_sweep.png"):
        assert (tmp_path / f"r{suffix}").stat().st_size > 0


OTHER_RUN = {
    "settings": {
        "target": "x",
        "dtype": "float32",
        "sampling": {"temperature": 0, "top_k": 0, "top_p": 1, "max_new_tokens": 8},
    },
    "environment": {},
    "records": [],
}


def test_bench_refuses_other_settings(tiny_dir, dataset, tmp_path, capsys):
    out = tmp_path / "r.json"
    out.write_text(json.dumps(OTHER_RUN))
    assert main(_args(tiny_dir, dataset, out)) == 2
    assert (
        capsys.readouterr().err == f"error: {out} holds results of other settings; pass another --out to start afresh\n"
    )


@pytest.mark.parametrize(
    "content",
    [
        b'{"a": 1}',
        b"[1, 2]",
        b"\x89PNG\r\n\x1a\n\0\0",
        b"{not json",
        b'"text"',
        json.dumps({**OTHER_RUN, "records": [{"method": "plain"}]}).encode(),
        json.dumps(
            {
                **OTHER_RUN,
                "records": [
                    {
                        "prompt_id": 1,
                        "task": "qa",
                        "method": "m",
                        "repeat": 0,
                        "new_tokens": 2,
                        "wall_s": 1,
                        "steps": [[]],
                    }
                ],
            }
        ).encode(),
    ],
)
def test_a_file_that_is_no_results_file_is_one_error_line(tiny_dir, dataset, tmp_path, capsys, content):
    """`bench --out FILE` (which resumes FILE) and `bench report FILE` on another JSON, a list or a binary
    gave a traceback."""
    f = tmp_path / "other.json"
    f.write_bytes(content)
    for argv in (_args(tiny_dir, dataset, f), ["bench", "report", str(f), "--no-plots"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"error: the results file {f}: ") and err.count("\n") == 1, err
    assert f.read_bytes() == content  # never written over


def test_bench_config_errors(tiny_dir, dataset, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(_args(tiny_dir, dataset, out, "--sweep", "bogus=1,2")) == 2
    assert "--sweep key 'bogus' is no spec key" in capsys.readouterr().err
    # a method's own setting is a spec key too: swept under the method that reads it
    args = _args(tiny_dir, dataset, out, "--methods", "plain,prompt_lookup", "--sweep", "max_ngram=2,3")
    at = args.index("--draft")
    del args[at : at + 4]  # --draft DIR --draft-layers 1: no method here uses a draft (given, it is refused)
    assert main(args) == 0
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"variants": {"x": {"method": "draft_model", "k": 0}}}))
    assert main(_args(tiny_dir, dataset, out, "--config", str(bad))) == 2
    assert "k (draft tokens per step) must be >= 1" in capsys.readouterr().err


def test_metric_functions_used_by_report():
    doc = {
        "records": [
            {
                "prompt_id": "a",
                "task": "qa",
                "method": "plain",
                "repeat": 0,
                "new_tokens": 10,
                "wall_s": 10.0,
                "steps": [[0, 0]] * 10,
            },
            {
                "prompt_id": "a",
                "task": "qa",
                "method": "draft_model",
                "repeat": 0,
                "new_tokens": 10,
                "wall_s": 4.0,
                "steps": [[4, 4], [4, 0], [4, 2]],
            },
        ]
    }
    r = aggregate(doc)["rows"]["draft_model"]
    assert r["speedup"] == 2.5 and r["mat"] == (5 + 1 + 3) / 3 and r["acceptance_rate"] == 6 / 12
    assert r["per_position"] == [2 / 3, 2 / 3, 1 / 3, 1 / 3]


def test_costs_command(tiny_dir, capsys, tmp_path):
    js, png = tmp_path / "c.json", tmp_path / "c.png"
    assert (
        main(
            [
                "costs",
                "--target",
                str(tiny_dir),
                "--dtype",
                "float32",
                "--tokens",
                "1,3,8",
                "--repeats",
                "1",
                "--tree",
                "--json",
                str(js),
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| backend, weights | 1 tok | 3 tok | 8 tok |" in out
    assert "| hf float32 chain | " in out and "| hf float32 tree | " in out
    assert "(1.00x)" in out and png.stat().st_size > 1000
    import json

    doc = json.loads(js.read_text())
    assert set(doc["rows"]["hf float32 tree"]) == {"1", "3", "8"} and doc["backend"] == "hf" and doc["cpu"]
    assert (
        set(doc["prefill"]["hf float32"]) == {"32", "512"} and "hf float32: prefill of 32 / 512 prompt tokens: " in out
    )


def test_costs_command_with_a_draft(tiny_dir, capsys, tmp_path):
    js = tmp_path / "c.json"
    assert (
        main(
            [
                "costs",
                "--target",
                str(tiny_dir),
                "--dtype",
                "float32",
                "--tokens",
                "1,3,8",
                "--repeats",
                "1",
                "--draft",
                str(tiny_dir),
                "--json",
                str(js),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| draft " in out and "| k | step ms | plain target tokens it costs |" in out
    assert json.loads(js.read_text())["draft"]["ms"].keys() == {"1", "3", "8"}


def test_break_even_acceptance():
    from specdraft.bench.costs import break_even_acceptance, chain_tokens

    assert chain_tokens(0.0, 4) == 1 and chain_tokens(1.0, 4) == 5 and chain_tokens(0.5, 1) == 1.5
    assert abs(break_even_acceptance(1.5, 1) - 0.5) < 1e-6  # one draft token, accepted half the time
    assert break_even_acceptance(6.0, 4) is None  # a step of 4 drafts can never yield 6 tokens
    alpha = break_even_acceptance(3.0, 6)
    assert abs(chain_tokens(alpha, 6) - 3.0) < 1e-6


def spec_bench_like(tmp_path):
    """40 prompts, 5 in each of 8 categories (covering the core18 preset), as a question.jsonl."""
    cats = ["translation", "summarization", "qa", "math_reasoning", "rag", "writing", "coding", "reasoning"]
    rows = [{"question_id": f"{c}{i}", "category": c, "turns": [f"prompt {c} {i}"]} for c in cats for i in range(5)]
    ds = tmp_path / "q.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ds


def test_datastore_corpus_excludes_the_bench_prompts(tmp_path):
    from specdraft.bench.corpus import write_corpus

    ds = spec_bench_like(tmp_path)
    out = tmp_path / "corpus.jsonl"
    info = write_corpus(str(out), "core18", max_chars=0, dataset=str(ds))
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert len(info["excluded_prompt_ids"]) == 18 and "translation0" in info["excluded_prompt_ids"]
    assert "prompt translation 0" not in texts and "prompt translation 3" in texts
    assert "prompt writing 0" not in texts and "prompt writing 1" in texts
    assert len(texts) == info["documents"] >= 40 - 18


def test_training_prompts_exclude_the_bench_prompts(tmp_path):
    from specdraft.bench.corpus import write_prompts
    from specdraft.core.prompts import load_prompts

    ds = spec_bench_like(tmp_path)
    out = tmp_path / "train.jsonl"
    info = write_prompts(str(out), "core18", dataset=str(ds))
    got = load_prompts(out)  # the training command reads it with the bench's own reader
    assert info["prompts"] == len(got) == 40 - 18
    assert {r["prompt"] for r in got}.isdisjoint({"prompt translation 0", "prompt writing 0"})
    assert "prompt translation 3" in {r["prompt"] for r in got}
    assert write_prompts(str(out), "core18", every=2, dataset=str(ds))["prompts"] == 11


def test_uad_baseline_leaves_the_engine_draft_intact(tiny_dir, dataset, tmp_path):
    """transformers' UAD (hf_assisted with another tokenizer) prunes its assistant's embeddings in place
    when sampling; the engine's cross-tokenizer draft_model in the same run must still work."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from specdraft.models import catalog

    d = tmp_path / "tiny_qwen_tok"
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=151936,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            eos_token_id=151643,
        )
    ).save_pretrained(d)
    for f in catalog.pull("qwen2.5-coder-0.5b").iterdir():
        if f.name.startswith(("tokenizer", "vocab", "merges", "chat_template")):
            shutil.copy(f, d / f.name)
    out = tmp_path / "uad.json"
    assert (
        main(
            [
                "bench",
                "--target",
                str(d),
                "--draft",
                str(tiny_dir),
                "--dtype",
                "float32",
                "--dataset",
                str(dataset),
                "--max-new-tokens",
                "6",
                "--methods",
                "plain,draft_model,hf_assisted",
                "--temperature",
                "1",
                "--no-plots",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    recs = json.loads(out.read_text())["records"]
    assert {r["method"] for r in recs} == {"plain", "draft_model", "hf_assisted"} and len(recs) == 12


@pytest.mark.slow
@pytest.mark.long
def test_headline_preset_runs_end_to_end_and_prints_the_results_row(tmp_path, capsys):
    """`make bench`'s command on Qwen 0.5B Q4_0 (SmolLM2's Q4_1 file does not convert to OpenVINO), 2 short
    prompts, 4 tokens: every decoder of the preset runs and reports its first token, the speedups are over
    the fastest plain decoder, and the README's row names the CPU, the date and both speedups."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("openvino_genai")
    from specdraft.cli import main
    from specdraft.core.errors import ModelFileError
    from specdraft.models import quantize
    from specdraft.models.cost_curve import cpu_name

    try:
        quantize.variant_path("qwen2.5-coder-0.5b", "Q4_0")
    except ModelFileError:  # made once per machine, as the openvino tests do
        quantize.quantize("qwen2.5-coder-0.5b", "Q4_0")
    out = tmp_path / "headline.json"
    assert (
        main(
            [
                "bench",
                "--preset",
                "headline",
                "--target",
                "qwen2.5-coder-0.5b:Q4_0",
                "--tasks",
                "qa,code_edit",
                "--n-per-task",
                "1",
                "--max-new-tokens",
                "4",
                "--threads",
                "1",
                "--no-plots",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    methods = {r["method"] for r in doc["records"]}
    assert methods == {
        "plain",
        "llama_cpp",
        "ov_genai",
        "llama_cpp_lookup",
        "auto",
        "openvino:plain",
        "openvino:suffix_k16",
    }, methods
    for r in doc["records"]:  # the real runners' streaming callbacks: the first token within the call
        assert 0 < r["first_token_s"] <= r["wall_s"], r["method"]
    assert len({r["prompt_id"] for r in doc["records"]}) == 2  # a qa prompt of core18, a code edit
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith(f"| {cpu_name()}, "))
    assert doc["environment"]["date"][:10] in row and "tok/s" in row and "identical" in row
    assert "2 prompts x 4 new tokens, greedy" in row and row.count("x** |") == 2  # decode phase, end to end
    assert "over the fastest plain decoder" in printed or "Speedup" in printed


def test_headline_preset_fills_only_the_options_not_given():
    """Typed at a default (--backend hf, --max-new-tokens 48 beside the preset's 128), an option was replaced
    by the preset's."""
    from specdraft.bench.harness import BenchOptions, plan_bench
    from specdraft.cli import build_parser, settings_from_args

    filled = plan_bench(BenchOptions(preset="headline")).opts
    assert (filled.backend, filled.max_new_tokens, filled.target) == ("llama", 128, "qwen2.5-coder-1.5b:Q4_0")
    given = plan_bench(BenchOptions(preset="headline", backend="hf", max_new_tokens=48, target="smollm2-135m")).opts
    assert (given.backend, given.max_new_tokens, given.target, given.llama_k) == ("hf", 48, "smollm2-135m", "4")
    a = build_parser().parse_args(["bench", "--preset", "headline", "--backend", "hf", "--max-new-tokens", "48"])
    opts = plan_bench(settings_from_args(BenchOptions, a)).opts
    assert (opts.backend, opts.max_new_tokens, opts.methods) == ("hf", 48, filled.methods)
    plain = plan_bench(BenchOptions(tasks="qa", n_per_task=1, draft="d")).opts  # no preset: the usual defaults
    assert (plain.backend, plain.max_new_tokens, plain.out) == ("hf", 128, "results/bench.json")


def test_a_backend_beside_the_runs_that_cannot_load_the_target_names_the_methods_on_it(monkeypatch):
    """`--preset headline --target smollm2-135m` runs on llama; OpenVINO cannot convert SmolLM2's file, and the
    error said "use --backend llama" instead of naming the preset's openvino methods."""
    from specdraft import api
    from specdraft.bench.harness import BenchOptions, load_bench, plan_bench
    from specdraft.core.errors import ConfigError, ModelFileError

    def load(target, backend=None, **kw):
        if backend == "openvino":
            raise ModelFileError(f"OpenVINO converts {target} wrongly")
        return api.SpecDecoder(tiny_llama(vocab=16))

    monkeypatch.setattr(api.SpecDecoder, "load", staticmethod(load))
    plan = plan_bench(BenchOptions(preset="headline", target="smollm2-135m", tasks="qa", n_per_task=1))
    with pytest.raises(ConfigError) as e:
        load_bench(plan, 1)
    assert str(e.value) == (
        "openvino:plain, openvino:suffix_k16 run on the openvino backend, which cannot load "
        "smollm2-135m here (OpenVINO converts smollm2-135m wrongly); leave them out of --methods"
    )


def test_multiturn_preset_resends_histories_and_hits_its_own_cache(tmp_path, monkeypatch, capsys):
    """--preset multiturn: every method sees the same turn prompts (histories built once), a method keeping
    its cache takes later turns' history from it, its [cold] twin never does, and outputs agree (greedy)."""
    from conftest import tiny_model_dir

    monkeypatch.setenv("SPECDRAFT_HOME", str(tmp_path / "home"))
    model = tiny_model_dir(tmp_path / "tiny")
    out = tmp_path / "mt.json"
    args = ["bench", "--preset", "multiturn", "--target", str(model), "--backend", "hf"]
    rc = main(args + ["--methods", "plain,plain[cold]", "--max-new-tokens", "4", "--out", str(out)])
    assert rc == 0
    recs = json.loads(out.read_text())["records"]
    assert {r["kind"] for r in recs} == {"chat", "agent"} and max(r["turn"] for r in recs) == 3
    by = {(r["conversation"], r["turn"], r["method"]): r for r in recs}
    for (conv, turn, m), r in by.items():
        twin = by[conv, turn, "plain[cold]" if m == "plain" else "plain"]
        assert r["prompt_tokens"] == twin["prompt_tokens"] and r["token_ids"] == twin["token_ids"]
        if m == "plain[cold]" or turn == 0:
            assert r["cached_tokens"] == 0
        else:
            assert r["cached_tokens"] > 0
    assert "later turns" in capsys.readouterr().out
    assert main(args + ["--k", "3"]) == 2
    assert "--preset multiturn does not take --k" in capsys.readouterr().err
