"""OpenVINO GenAI's EAGLE-3 decoding of our heads (bench/ov_eagle3.py): the converted draft computes what
the torch head computes (a prefill, then a step over its KV cache), carries what GenAI's pipeline looks
for (names, rt_info, a cache its paged-attention rewrite accepts), the target IR's layer names are
rewritten for it, and the bench's ov_genai_eagle3 runner is configured or refused clearly. The slow test
runs GenAI itself on Qwen2.5-Coder-0.5B's IR: greedy tokens equal its plain decoding, with a head that
drafts and gets accepted."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from specdraft.core.errors import ConfigError

ov = pytest.importorskip("openvino", reason="OpenVINO GenAI's EAGLE-3 runner needs openvino (make setup installs it)")

from specdraft.bench import ov_eagle3  # noqa: E402
from specdraft.models.eagle3 import Eagle3Head, Eagle3Shape  # noqa: E402

SHAPE = Eagle3Shape(
    hidden_size=64,
    target_hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=48,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
    vocab_size=300,
    draft_vocab_size=50,
    layers=(2, 4, 6),
)


def tiny_head(seed=0):
    torch.manual_seed(seed)
    head = Eagle3Head(SHAPE)
    head.set_draft_ids(torch.randperm(SHAPE.vocab_size)[: SHAPE.draft_vocab_size].sort().values)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return head.eval()


def with_embedding(model, table: torch.Tensor):
    """``model`` with the embedding table GenAI would copy in from the target."""
    from openvino import opset13

    ov_eagle3.embedding_gather(model).input(0).replace_source_output(opset13.constant(table.numpy()).output(0))
    model.validate_nodes_and_infer_types()
    return ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


def test_the_converted_draft_computes_the_heads_logits_over_its_cache():
    head, table = tiny_head(), torch.randn(SHAPE.vocab_size, SHAPE.hidden_size)
    ids, feats = torch.randint(0, SHAPE.vocab_size, (1, 5)), torch.randn(1, 5, 3 * SHAPE.hidden_size)
    cache = head.new_cache()
    with torch.no_grad():
        want = [head.draft_logits(head(feats[:, s], table[ids[:, s]], cache=cache)) for s in (slice(0, 3), slice(3, 5))]
    compiled = with_embedding(ov_eagle3.convert_head(head), table)
    past_key = past_value = np.zeros((1, SHAPE.num_key_value_heads, 0, SHAPE.head_dim), np.float32)
    got = []
    for s in (slice(0, 3), slice(3, 5)):
        out = compiled(
            {
                "input_ids": ids[:, s].numpy(),
                "hidden_states": feats[:, s].numpy(),
                "attention_mask": np.ones((1, s.stop), np.int64),
                "position_ids": np.arange(s.start, s.stop)[None],
                "past_key": past_key,
                "past_value": past_value,
            }
        )
        past_key, past_value = out["present_key"], out["present_value"]
        got.append(torch.from_numpy(out["logits"]))
        assert (out["d2t"] == head.d2t.numpy()).all()
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-3), float((g - w).abs().max())


def test_the_draft_ir_carries_what_genais_eagle3_pipeline_looks_for():
    from openvino._offline_transformations import paged_attention_transformation

    model = ov_eagle3.draft_ir(tiny_head())
    assert [p.get_any_name() for p in model.inputs] == [
        "input_ids",
        "hidden_states",
        "attention_mask",
        "position_ids",
        "beam_idx",
    ]
    assert [o.get_any_name() for o in model.outputs] == ["logits", "d2t"]
    assert model.get_rt_info("eagle3_mode").astype(str) == "True"
    assert model.get_rt_info("hidden_layers_list").astype(str) == "1 3 5"  # the decoder layers whose OUTPUT is read
    ops = model.get_ordered_ops()
    assert [
        op.get_friendly_name()
        for op in ops
        if "midlayer" in op.get_friendly_name() and op.get_type_name() == "Add" and ov_eagle3._adds_mlp(op)
    ] == ["midlayer/mlp_residual_add"]
    fc = [
        op
        for op in ops
        if op.get_type_name() == "MatMul" and op.input_value(0).get_node().get_friendly_name() == "hidden_states"
    ]
    assert len(fc) == 1 and fc[0].get_attributes()["transpose_b"]  # GenAI moves this one into the target
    assert model.output("d2t").get_node().input_value(0).get_node().get_friendly_name() == "d2t"
    paged_attention_transformation(model, False, False)  # what GenAI's continuous batching does to it
    assert [op.get_type_name() for op in model.get_ordered_ops()].count("PagedAttentionExtension") == 1


def test_the_targets_layer_adds_are_renamed_and_a_foreign_ir_is_refused(tmp_path):
    xml = tmp_path / "openvino_model.xml"
    xml.write_text(
        '<layer id="1" name="model.layers.self_attn.add1.layer0" type="Add"/>\n'
        '<layer id="2" name="model.layers.self_attn.add1.layer11" type="Add"/>\n'
        '<layer id="3" name="model.layers.self_attn.add0.layer11" type="Add"/>\n'
    )
    text, n = ov_eagle3._main_xml_for_genai(xml)
    assert n == 2 and 'name="model.layers.11/self_attn.add1"' in text and 'name="model.layers.0/self_attn.add1"' in text
    assert 'name="model.layers.self_attn.add0.layer11"' in text  # the attention's add is left alone
    xml.write_text('<layer id="1" name="__module.model.layers.3/aten::add/Add_1" type="Add"/>\n')
    assert ov_eagle3._main_xml_for_genai(xml)[1] == 4  # optimum-intel's names are GenAI's already
    xml.write_text('<layer id="1" name="blocks.0.add" type="Add"/>\n')
    with pytest.raises(ConfigError, match="no decoder layers named"):
        ov_eagle3._main_xml_for_genai(xml)
    with pytest.raises(ConfigError, match="no OpenVINO IR"):
        ov_eagle3._main_xml_for_genai(tmp_path / "missing.xml")
    stamp = tmp_path / ov_eagle3.STAMP
    assert ov_eagle3._stamped_source(stamp) is None
    stamp.write_text("{torn")
    assert ov_eagle3._stamped_source(stamp) is None  # made again, not a traceback
    stamp.write_text(json.dumps({"source": "a b"}))
    assert ov_eagle3._stamped_source(stamp) == "a b"


def test_the_bench_runs_ov_genai_eagle3_with_the_specs_head_and_refuses_it_without_one():
    from specdraft.bench.harness import BenchOptions, _ov_genai_eagle3_dirs, build_variants

    opts = BenchOptions(sweep=[], methods="plain,ov_genai_eagle3", llama_draft_k="3,5")
    variants = build_variants(opts, {"spec": {"head": "/heads/h"}})
    assert [(n, k, s) for n, k, s in variants[1:]] == [
        ("ov_genai_eagle3[k=3]", "ov_genai_eagle3", {"k": 3, "head": "/heads/h"}),
        ("ov_genai_eagle3[k=5]", "ov_genai_eagle3", {"k": 5, "head": "/heads/h"}),
    ]
    with pytest.raises(ConfigError, match="needs an EAGLE-3 head"):
        _ov_genai_eagle3_dirs(opts, None, "/ir")
    with pytest.raises(ConfigError, match="greedy only"):
        _ov_genai_eagle3_dirs(BenchOptions(temperature=0.7), "/heads/h", "/ir")


@pytest.mark.slow
def test_genai_decodes_with_our_head_exactly_as_without_it(tmp_path):
    """A random head (drafts rejected) and one that always drafts the plain output's most common token
    (accepted where it comes next): GenAI's EAGLE-3 tokens equal its plain greedy tokens on the same IR."""
    genai = pytest.importorskip("openvino_genai")
    from head_util import save_eagle3_head
    from specdraft.models import head_formats
    from specdraft.models.backends import load_model, resolve_gguf
    from specdraft.models.openvino import ir_path

    name = "qwen2.5-coder-0.5b:Q4_0"
    xml = ir_path(resolve_gguf(name)[0], name)
    target = load_model(name, backend="llama")
    head_dir = save_eagle3_head(target, tmp_path / "head", torch.arange(1000))

    def generate(main, draft=None):
        kw = {"draft_model": genai.draft_model(str(draft), "CPU")} if draft else {}
        pipe = genai.LLMPipeline(str(main), "CPU", INFERENCE_NUM_THREADS=torch.get_num_threads(), **kw)
        ids = pipe.get_tokenizer().encode("def fibonacci(n):\n    # return the n-th Fibonacci number\n").input_ids
        c = genai.GenerationConfig(max_new_tokens=16, do_sample=False)
        if draft:
            c.num_assistant_tokens = 3
        out = pipe.generate(genai.TokenizedInputs(ids, ov.Tensor(np.ones(ids.shape, np.int64))), c)
        return [int(t) for t in out.tokens[0]], out.extended_perf_metrics.get_num_accepted_tokens() if draft else 0

    plain, _ = generate(xml.parent)
    dirs = ov_eagle3.prepare(head_dir, xml, tmp_path / "random")
    assert generate(dirs.main, dirs.draft)[0] == plain
    often = max(set(plain[1:]), key=plain[1:].count)
    ck = head_formats.read(head_dir, json.loads((head_dir / "config.json").read_text()), target.facts.num_layers)
    head = Eagle3Head(replace(ck.shape, draft_vocab_size=50))
    head.set_draft_ids(torch.arange(often, often + 50))
    with torch.no_grad():
        head.norm.weight.zero_()  # every draft logit 0: the argmax is draft index 0, the token ``often``
    head_formats.write(tmp_path / "eager", head.shape, head.state_dict(), dtype=torch.float32)
    dirs = ov_eagle3.prepare(tmp_path / "eager", xml, tmp_path / "eager-genai")
    tokens, accepted = generate(dirs.main, dirs.draft)
    assert tokens == plain and accepted > 0
