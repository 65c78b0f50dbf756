"""Self-speculation: layer-skip / early-exit views of the target, and `specdraft tune-skip`."""

import copy
import json

import pytest
import torch

from conftest import logits_of, tiny_model_dir
from specdraft.cli import main
from specdraft.models.views import layer_view


@pytest.mark.slow
def test_views_equal_truncated_and_layer_deleted_models(smol_f32):
    from specdraft.models.backends import load_model
    from specdraft.models.hf import HFModel

    m = smol_f32
    ids = torch.tensor(m.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"])
    before = logits_of(m, ids, keep=3)
    # early exit == a model truncated to its first 12 layers
    trunc = load_model("smollm2-135m", "float32", num_layers=12)
    v = layer_view(m, list(range(12)))
    assert torch.allclose(logits_of(v, ids, keep=3), logits_of(trunc, ids, keep=3), atol=1e-5)
    # layer skip == a deep copy with those layers deleted
    skip = [3, 8, 15, 22]
    keep = [i for i in range(m.num_layers) if i not in skip]
    manual = copy.deepcopy(m.model)
    manual.model.layers = torch.nn.ModuleList([manual.model.layers[i] for i in keep])
    want = logits_of(HFModel(manual), ids, keep=3)
    v2 = layer_view(m, keep)
    got = logits_of(v2, ids, keep=2)
    assert torch.allclose(got, want[1:], atol=1e-5)
    # incremental decoding through the view's rows equals the one-shot forward
    rows = v2.new_rows()
    rows.add_rows([ids[:-1].tolist()])
    assert torch.allclose(rows.forward([ids[-1:].tolist()])[0, -1], want[-1], atol=1e-4)
    # the target itself is untouched (shared weights, its own layers and cache)
    assert torch.equal(logits_of(m, ids, keep=3), before)
    assert len(m.model.model.layers) == m.num_layers


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny4"), layers=4)


def test_tune_skip_writes_a_config_that_layer_skip_loads(tiny4, tmp_path, capsys):
    ds = tmp_path / "q.jsonl"
    ds.write_text(
        "\n".join(
            json.dumps({"question_id": i, "category": c, "turns": [f"Say {c} {i}."]})
            for i, c in enumerate(["qa", "qa", "writing"])
        )
        + "\n"
    )
    out = tmp_path / "skip.json"
    assert (
        main(
            [
                "tune-skip",
                "--target",
                str(tiny4),
                "--dataset",
                str(ds),
                "--prompts-per-task",
                "1",
                "--tokens",
                "6",
                "--max-k",
                "2",
                "--max-evals",
                "4",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    d = json.loads(out.read_text())
    assert d["num_layers"] == 4 and isinstance(d["skip_layers"], list) and all(0 < i < 3 for i in d["skip_layers"])
    assert d["evaluations"] == 4 and len(d["search_log"]) == 4  # 2 single layers, then sets of 1 and 2
    assert all(0 <= r["agreement"] <= 1 for r in d["search_log"]) and [len(r["skip"]) for r in d["search_log"]] == [
        1,
        1,
        1,
        2,
    ]
    assert sorted(d["tuning_prompts"]) == ["1", "2"]  # the last prompt of each task
    capsys.readouterr()
    cfg = tmp_path / "manual.json"
    cfg.write_text(json.dumps({"num_layers": 4, "skip_layers": [1, 2]}))
    assert (
        main(
            [
                "generate",
                "--target",
                str(tiny4),
                "--dtype",
                "float32",
                "--method",
                "layer_skip",
                "--skip-config",
                str(cfg),
                "--max-new-tokens",
                "5",
                "--json",
                "hello",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert len(res["token_ids"]) == 5 and res["stats"]["drafted"] > 0
    cfg.write_text(json.dumps({"num_layers": 30, "skip_layers": [1]}))
    assert (
        main(
            [
                "generate",
                "--target",
                str(tiny4),
                "--dtype",
                "float32",
                "--method",
                "layer_skip",
                "--skip-config",
                str(cfg),
                "hello",
            ]
        )
        == 2
    )
    assert "tuned for a 30-layer model; this target has 4 layers" in capsys.readouterr().err
    assert main(["generate", "--target", str(tiny4), "--dtype", "float32", "--method", "early_exit", "hello"]) == 2
    assert "needs exit_layer >= 1" in capsys.readouterr().err
    assert (
        main(
            [
                "generate",
                "--target",
                str(tiny4),
                "--dtype",
                "float32",
                "--method",
                "early_exit",
                "--exit-layer",
                "4",
                "hello",
            ]
        )
        == 2
    )
    assert "exit_layer must be < the target's 4 layers" in capsys.readouterr().err
