"""EAGLE-3 checkpoints of other engines (models/head_formats.py): a checkpoint built from each format's
reference key list and config (SpecForge / the EAGLE repository, vLLM, speculators), random weights, loads
and decodes losslessly; ours exports to each and loads back bit-identical; the aux-layer conventions
(vLLM's ids as stored, SGLang's one lower) land on the same layers; a pytorch_model.bin loads without
unpickling code; a wrong shape or a missing tensor is one error line."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from conftest import tiny_llama
from head_util import random_eagle3_head
from specdraft.cli import main
from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.core.errors import ConfigError
from specdraft.models import head_formats
from specdraft.models.heads import load_head

V = 64
DRAFT_IDS = torch.tensor(sorted(set(range(0, V, 3)) | {1, 2}))
PROMPT = [1, 5, 9, 2, 7, 3]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=V, hidden=32, layers=4)


@pytest.fixture(scope="module")
def head(target):
    return random_eagle3_head(target, DRAFT_IDS)


def reference_checkpoint(d, head, fmt):
    """``head`` written the way ``fmt``'s own tools write it: their key names and config fields, no
    specdraft section (so nothing of ours helps the reader)."""
    s = head.shape
    st = {k: v.clone() for k, v in head.state_dict().items()}
    if fmt == "speculators":
        st = {("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in st.items()}
        st["embed_tokens.weight"] = torch.zeros(s.vocab_size, s.hidden_size)  # a copy of the target's: ignored
    if fmt == "vllm":
        st = {("model." + k if not k.startswith("lm_head") else k): v for k, v in st.items()}
    cfg = head_formats.config_dict(s, fmt)
    if fmt == "specforge":  # SGLang's ids only, under eagle_config
        del cfg["eagle_aux_hidden_state_layer_ids"]
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in st.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def plain(target, n=12):
    from specdraft.api import SpecDecoder

    return SpecDecoder(target).generate(PROMPT, sampling=SamplingParams(max_new_tokens=n), spec={"method": "plain"})


@pytest.mark.parametrize("fmt", head_formats.FORMATS)
def test_each_format_loads_and_decodes_losslessly(tmp_path, target, head, fmt):
    from specdraft.api import SpecDecoder

    d = reference_checkpoint(tmp_path / fmt, head, fmt)
    loaded, meta = load_head(d, target, expect_type="eagle3")
    assert loaded.layers == head.layers and meta["type"] == "eagle3"
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k].to(v.dtype), v), k
    dec = SpecDecoder(target)
    ref = plain(target)
    for tree in ("chain", "dynamic"):
        out = dec.generate(
            PROMPT,
            sampling=SamplingParams(max_new_tokens=12),
            spec=SpecConfig(method="eagle3", head=str(d), k=3, tree=tree),
        )
        assert out.token_ids == ref.token_ids, (fmt, tree)
        assert sum(s.drafted for s in out.stats.steps) > 0


def test_sglang_ids_are_one_lower_than_vllms(tmp_path, head):
    cfg = head_formats.config_dict(head.shape, "specforge")
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(head.layers)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in head.layers]
    only_sglang = {**cfg, "eagle_aux_hidden_state_layer_ids": None}
    assert head_formats._aux_layers(only_sglang, "specforge", 4, "x") == head.layers
    only_vllm = {**cfg, "eagle_config": {}}
    assert head_formats._aux_layers(only_vllm, "vllm", 4, "x") == head.layers
    assert head_formats._aux_layers({}, "vllm", 28, "x") == (2, 14, 25)  # nothing said: the default


@pytest.mark.parametrize("fmt", head_formats.FORMATS)
def test_export_then_load_is_bit_identical(tmp_path, target, head, fmt):
    src = tmp_path / "ours"
    head_formats.write(src, head.shape, head.state_dict(), {"type": "eagle3", "target": "tiny"}, dtype=torch.bfloat16)
    assert main(["heads", "export", str(src), str(tmp_path / "out"), "--format", fmt]) == 0
    a = head_formats.read(src, json.loads((src / "config.json").read_text()), 4)
    b = head_formats.read(tmp_path / "out", json.loads((tmp_path / "out" / "config.json").read_text()), 4)
    assert b.format == fmt and a.shape == b.shape
    for k in a.state:
        assert torch.equal(a.state[k], b.state[k]), k


def test_pytorch_model_bin_loads_without_running_code(tmp_path, target, head):
    d = reference_checkpoint(tmp_path / "bin", head, "specforge")
    st = head_formats._load_tensors(d)
    (d / "model.safetensors").unlink()
    torch.save(st, d / "pytorch_model.bin")
    assert load_head(d, target, expect_type="eagle3")[0].layers == head.layers

    class Planted:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    torch.save({"fc.weight": Planted()}, d / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_head(d, target, expect_type="eagle3")
    assert not (tmp_path / "ran").exists()


DAMAGE = {
    "a tensor of the wrong shape": (
        lambda st, cfg: st.update({"fc.weight": st["fc.weight"][:, :-1]}),
        "fc.weight has shape",
    ),
    "a tensor missing": (lambda st, cfg: st.pop("norm.weight"), "lacks norm.weight"),
    "a hidden size the target lacks": (
        lambda st, cfg: (cfg.update(target_hidden_size=48), st.update({"fc.weight": torch.zeros(32, 144)})),
        "target hidden size 48",
    ),
    "aux layers past the target": (
        lambda st, cfg: cfg.update(eagle_aux_hidden_state_layer_ids=[1, 2, 9]),
        "does not have",
    ),
    "draft ids past the vocabulary": (lambda st, cfg: st.update({"d2t": st["d2t"] + V}), "outside the target"),
    "an unknown tensor": (lambda st, cfg: st.update({"midlayer.extra": torch.zeros(2)}), "does not know"),
    # fields of a head from someone else, each refused before anything is sized by it
    "a 400-digit hidden size": (lambda st, cfg: cfg.update(hidden_size=10**400), "hidden_size must be an integer"),
    "a 400-digit rope_theta": (lambda st, cfg: cfg.update(rope_theta=10**400), "rope_theta must be a finite"),
    "key/value heads that do not divide the heads": (
        lambda st, cfg: (
            cfg.update(num_key_value_heads=3),
            st.update({f"midlayer.self_attn.{p}_proj.weight": torch.zeros(24, 64) for p in "kv"}),
        ),
        "not a multiple of num_key_value_heads 3",
    ),
    "a 10**12 vocabulary, t2d absent": (
        lambda st, cfg: (cfg.update(vocab_size=10**12), st.pop("t2d")),
        "vocab_size must be an integer from 1 to",
    ),
    "10**12 target and draft vocabularies, no maps": (
        lambda st, cfg: (cfg.update(vocab_size=10**12, draft_vocab_size=10**12), st.pop("t2d"), st.pop("d2t")),
        "vocab_size must be an integer from 1 to",
    ),
    "a 10**6 draft vocabulary, no maps": (  # within the bounds: the weights' shapes refuse it, before d2t is made
        lambda st, cfg: (cfg.update(draft_vocab_size=10**6), st.pop("t2d"), st.pop("d2t")),
        "lm_head.weight has shape",
    ),
    "an int8 scale of the wrong shape": (
        lambda st, cfg: st.update({"fc.weight": st["fc.weight"].to(torch.int8), "fc.weight.int8_scale": torch.ones(3)}),
        "one float scale per row of fc.weight",
    ),
    "a 0-d int8 scale": (
        lambda st, cfg: st.update(
            {"fc.weight": st["fc.weight"].to(torch.int8), "fc.weight.int8_scale": torch.tensor(1.0)}
        ),
        "one float scale per row of fc.weight",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_checkpoint_is_one_error_line(tmp_path, target, head, capsys, case):
    d = reference_checkpoint(tmp_path / "h", head, "specforge")
    st = head_formats._load_tensors(d)
    cfg = json.loads((d / "config.json").read_text())
    damage, says = DAMAGE[case]
    damage(st, cfg)
    save_file({k: v.contiguous() for k, v in st.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=says):
        load_head(d, target, expect_type="eagle3")
    if "target" in case:  # (heads info knows no target)
        return
    capsys.readouterr()
    assert main(["heads", "info", str(d)]) == 2  # the CLI: one error line, no traceback
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and re.search(says, err[0]), err
