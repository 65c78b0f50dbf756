"""bench --ray and train --ray on a local 2-CPU Ray instance with SmolLM2-135M (float32, 8 tokens):
sharded outputs equal unsharded ones token for token, resume, per-worker speedups, option errors."""

import json
import sys

import pytest
import torch

from specdraft.bench.report import aggregate, render, speedup_over
from specdraft.cli import main

pytest.importorskip("ray")
pytestmark = pytest.mark.long  # Ray clusters end to end (make test-long)

PROMPTS = ["Name three colors.", "Write a haiku about rain.", "Explain gravity briefly."]


def bench_args(ds, out, *extra):
    return [
        "bench",
        "--target",
        "smollm2-135m",
        "--dtype",
        "float32",
        "--dataset",
        str(ds),
        "--max-new-tokens",
        "8",
        "--methods",
        "plain,prompt_lookup",
        "--threads",
        "1",
        "--no-plots",
        "--out",
        str(out),
        *extra,
    ]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    p = tmp_path_factory.mktemp("ds") / "q.jsonl"
    p.write_text(
        "".join(
            json.dumps({"question_id": f"p{i}", "category": "qa", "turns": [t]}) + "\n" for i, t in enumerate(PROMPTS)
        )
    )
    return p


@pytest.fixture(scope="module")
def local_doc(dataset, tmp_path_factory):
    """The unsharded run every sharded one is compared with."""
    out = tmp_path_factory.mktemp("local") / "r.json"
    assert main(bench_args(dataset, out)) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def ray_local():
    from specdraft.scale import cluster

    ray = cluster.connect(None, num_cpus=2)
    yield ray
    ray.shutdown()


def tokens(doc):
    return {(r["prompt_id"], r["method"]): r["token_ids"] for r in doc["records"]}


# --- errors (no Ray instance needed) --------------------------------------------------------------
def test_ray_option_errors(dataset, tmp_path, monkeypatch, capsys):
    out = tmp_path / "r.json"
    assert main(bench_args(dataset, out, "--ray", "--ray-workers", "0")) == 2
    assert "--ray-workers must be >= 1" in capsys.readouterr().err
    assert main(bench_args(dataset, out, "--ray-workers", "2")) == 2
    assert "need --ray" in capsys.readouterr().err
    import ray

    if not ray.is_initialized():  # a malformed address fails at once (an unreachable one only after Ray's timeout)
        assert main(bench_args(dataset, out, "--ray=not-an-address")) == 2
        assert "cannot reach the Ray cluster at 'not-an-address'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # ray not installed
    assert main(bench_args(dataset, out, "--ray")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs Ray" in err[0] and "make setup-ray" in err[0]
    assert (
        main(
            [
                "train",
                "medusa",
                "--target",
                "smollm2-135m",
                "--data",
                str(dataset),
                "-o",
                str(tmp_path / "h"),
                "--ray",
                "--ray-workers",
                "0",
            ]
        )
        == 2
    )
    assert not out.exists()
    eagle3 = ["train", "eagle3", "--target", "smollm2-135m", "-o", str(tmp_path / "e3"), "--train-only", "--ray"]
    assert main(eagle3) == 2 and "--ray make data" in capsys.readouterr().err  # nothing to shard: refused


def test_speedup_is_per_worker_then_token_weighted():
    def rec(w, method, n, s):
        return {
            "prompt_id": f"{w}-p",
            "task": "qa",
            "method": method,
            "repeat": 0,
            "new_tokens": n,
            "wall_s": s,
            "worker": w,
        }

    recs = [
        rec("w0", "plain", 10, 10.0),
        rec("w0", "x", 10, 5.0),  # 2x on a slow worker
        rec("w1", "plain", 30, 3.0),
        rec("w1", "x", 30, 2.0),
    ]  # 1.5x on a fast one
    want = (10 * 2.0 + 30 * 1.5) / 40  # pooled totals would say (40 / 7) / (40 / 13) = 1.86x
    assert speedup_over(recs[1::2], recs[0::2]) == pytest.approx(want)
    assert aggregate({"records": recs})["rows"]["x"]["speedup"] == pytest.approx(want)
    for r in recs:
        del r["worker"]  # one machine: the totals, as before
    assert speedup_over(recs[1::2], recs[0::2]) == pytest.approx((40 / 7) / (40 / 13))


# --- bench --ray ----------------------------------------------------------------------------------
def test_bench_sharded_equals_unsharded(ray_local, dataset, local_doc, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(bench_args(dataset, out, "--ray", "--ray-workers", "2", "--ray-worker-cpus", "1")) == 0
    doc = json.loads(out.read_text())
    assert doc["settings"] == local_doc["settings"]
    got, want = tokens(doc), tokens(local_doc)
    assert len(doc["records"]) == len(got) == 3 * 2 and got == want
    assert len({tuple(v) for v in want.values()}) == 3  # the prompts' outputs differ: a mix-up would show
    assert set(doc["workers"]) == {"w0", "w1"}
    assert {r["worker"] for r in doc["records"]} == {"w0", "w1"}
    for r in doc["records"]:
        info = doc["workers"][r["worker"]]
        assert r["node"] == {k: info[k] for k in ("host", "address", "cpu", "cores")} and info["threads"] == 1
        assert r["method"] == "plain" or r["exact"] is True
    by_prompt = {}
    for r in doc["records"]:  # every method of a prompt ran on one worker
        by_prompt.setdefault(r["prompt_id"], set()).add(r["worker"])
    assert all(len(ws) == 1 for ws in by_prompt.values())
    md = render(doc, out, plots=False)
    assert "Sharded over 2 Ray workers" in md and "computed per worker" in md


def test_bench_ray_resumes(ray_local, dataset, local_doc, tmp_path, capsys):
    out = tmp_path / "r.json"
    first = [r for r in local_doc["records"] if r["prompt_id"] == "p1"]
    out.write_text(json.dumps({**local_doc, "records": first}))
    assert main(bench_args(dataset, out, "--ray")) == 0
    assert "bench on Ray: 2 prompt(s) over 2 worker(s)" in capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["records"][:2] == first  # kept as they were, not rerun
    assert sorted((r["prompt_id"], r["method"]) for r in doc["records"][2:]) == [
        ("p0", "plain"),
        ("p0", "prompt_lookup"),
        ("p2", "plain"),
        ("p2", "prompt_lookup"),
    ]
    assert all("worker" in r for r in doc["records"][2:]) and tokens(doc) == tokens(local_doc)


# --- train --ray ----------------------------------------------------------------------------------
def test_train_data_on_ray_equals_local(ray_local, tmp_path, monkeypatch, capsys):
    from specdraft.api import SpecDecoder
    from specdraft.commands.train import data as train_data

    monkeypatch.setattr(train_data, "DATA_BATCH", 2)  # 4 prompts: 2 batches, one per worker
    prompts = PROMPTS + ["What is 2 + 3?"]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = tmp_path / "head"
    assert (
        main(
            [
                "train",
                "medusa",
                "--target",
                "smollm2-135m",
                "--data",
                str(data),
                "-o",
                str(out),
                "--steps",
                "1",
                "--batch-size",
                "8",
                "--heads",
                "1",
                "--max-new-tokens",
                "6",
                "--threads",
                "1",
                "--ray",
                "--ray-workers",
                "2",
            ]
        )
        == 0
    )
    assert "w0 on " in (err := capsys.readouterr().err) and "w1 on " in err and "1 batch(es)" in err
    blob = torch.load(out / "data.pt", weights_only=True)
    dec = SpecDecoder.load("smollm2-135m", dtype="float32", threads=1, backend="hf")
    local = train_data.build_data(dec, prompts, 6, True)
    assert len(blob["seqs"]) == len(local) == 4
    for s, t in zip(blob["seqs"], local):
        assert s["tokens"].tolist() == t["tokens"].tolist() and s["n_prompt"] == t["n_prompt"]
        torch.testing.assert_close(s["hidden"], t["hidden"])
    assert blob["meta"]["max_new_tokens"] == 6 and (out / "head.safetensors").exists()
