"""Naming no method runs ``auto`` (library, `specdraft generate`, `serve`), falling back to the old default
(draft_model with a draft, else prompt_lookup) when auto cannot run; `bench` names its report and plots."""

import logging

from conftest import tiny_llama
from specdraft.api import SpecDecoder
from specdraft.cli import build_parser, spec_from_args
from specdraft.config import SamplingParams, SpecConfig, spec_with_default


def test_spec_with_default():
    assert spec_with_default(None, has_draft=False).method == "auto"
    assert spec_with_default({"k": 3}, has_draft=True).method == "auto"
    assert spec_with_default({"method": "plain"}, has_draft=True).method == "plain"
    # fields auto does not take: the method they were written for
    assert spec_with_default({"tree": "static"}, has_draft=True).method == "draft_model"


def test_cli_defaults_to_auto():
    for cmd in (["generate", "hi"], ["serve"]):
        a = build_parser().parse_args(cmd)
        spec = spec_from_args(a)
        assert spec.method == "auto" and a.method_defaulted
    a = build_parser().parse_args(["generate", "--method", "plain", "hi"])
    assert spec_from_args(a).method == "plain" and not a.method_defaulted


def test_library_defaults_to_auto_and_falls_back(tmp_path, caplog):
    dec = SpecDecoder(tiny_llama(vocab=16), None)
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    plain = dec.generate([1, 2, 3, 1, 2], sp, {"method": "plain"}).token_ids
    out = dec.generate([1, 2, 3, 1, 2], sp)  # no spec: auto, lossless
    assert out.token_ids == plain and out.stats.arms  # auto's steps name their arms
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="specdraft"):
        used = dec.usable(SpecConfig(method="auto", autotune=str(bad)))
    assert used.method == "prompt_lookup" and "auto cannot run here" in caplog.text
    with caplog.at_level(logging.WARNING, logger="specdraft"):
        assert dec.generate([1, 2, 3, 1, 2], sp, {"autotune": str(bad)}).token_ids == plain
    assert dec.usable(SpecConfig(method="plain")).method == "plain"
