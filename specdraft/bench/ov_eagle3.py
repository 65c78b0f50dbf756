"""OpenVINO GenAI's EAGLE-3 decoding of our heads: the two model directories it reads, made from an
EAGLE-3 head directory (any format models/head_formats.py reads) and the IR of the target.

What OpenVINO GenAI (2026.4) needs, read from its source (``speculative_decoding/eagle3_model_transforms``):

- The draft directory's ``openvino_model.xml`` carries rt_info ``eagle3_mode`` (GenAI then runs its
  EAGLE-3 pipeline) and ``hidden_layers_list``: the three decoder layers whose OUTPUT the head reads,
  i.e. our hidden-states indices - 1. Without the list GenAI takes layers 2, N/2 and N-3 from the main
  directory's config.json (the IR GenAI writes from a GGUF file has none: it refuses), and those are
  the outputs of layers the reference heads read the inputs of: one layer off.
- Draft inputs ``input_ids``, ``hidden_states`` (the fused target features, last dimension dynamic),
  ``attention_mask``, ``position_ids``, ``beam_idx``; a stateful KV cache (ReadValue/Assign around an
  SDPA, which GenAI turns into paged attention); outputs ``logits`` (draft vocabulary) and ``d2t`` (a
  Result of an int64 Constant whose name holds ``d2t``: the offsets, target id = draft index + d2t).
- GenAI edits both graphs when it loads them: the MatMul that reads the draft's ``hidden_states``
  input (our ``fc``, transpose_b) moves into the main model, after a concat of the residual Adds that
  end the listed decoder layers, found by friendly names holding ``layers.{i}/`` (the names
  optimum-intel's exporter gives); the draft's next hidden state is the residual Add whose name holds
  ``midlayer`` (the layer's pre-norm output, as EAGLE-3 feeds back); the draft's embedding Gather gets
  the main model's embedding weights (so the draft holds a one-row placeholder).

The IR GenAI writes from a GGUF file (models/openvino.py) names those Adds
``model.layers.self_attn.add1.layer{i}``: the main directory here holds a copy of its XML with them renamed
``model.layers.{i}/self_attn.add1`` and links to its weights and tokenizer. optimum-intel's exporter
(``optimum-cli export openvino --trust-remote-code`` of a LlamaForCausalLMEagle3 checkpoint) makes an
equivalent draft IR but needs transformers < 5.6 and sets no ``hidden_layers_list``; the conversion here
needs only torch and openvino.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..core.errors import ConfigError
from ..models.openvino import FEATURE_ADD

MAIN_ADD = re.compile('name="' + re.escape(FEATURE_ADD.format("")) + r'(\d+)"')  # GenAI's GGUF reader's names
TOKENIZER_FILES = (
    "openvino_tokenizer.xml",
    "openvino_tokenizer.bin",
    "openvino_detokenizer.xml",
    "openvino_detokenizer.bin",
)
STAMP = "specdraft_eagle3.json"


class _DraftGraph(nn.Module):
    """The head as one forward over explicit KV tensors (made stateful after conversion), in the layout
    GenAI's EAGLE-3 pipeline edits (module doc)."""

    def __init__(self, head):
        super().__init__()
        self.head = head
        self.embed_tokens = nn.Embedding(1, head.shape.hidden_size)  # GenAI puts the target's weights here

    def forward(self, input_ids, hidden_states, attention_mask, position_ids, past_key, past_value):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        h, s = self.head, self.head.shape
        layer, attn = h.midlayer, h.midlayer.self_attn
        B, T = input_ids.shape
        g = h.fc(hidden_states)
        g_norm = layer.hidden_norm(g)
        residual = g_norm if s.norm_before_residual else g
        x = torch.cat([layer.input_layernorm(self.embed_tokens(input_ids)), g_norm], dim=-1)
        q = attn.q_proj(x).view(B, T, s.num_attention_heads, s.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(B, T, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(B, T, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        cos, sin = h.rotary(g, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = torch.cat([past_key, k], dim=2), torch.cat([past_value, v], dim=2)
        out = nn.functional.scaled_dot_product_attention(
            q, _repeat_kv(k, s), _repeat_kv(v, s), attn_mask=_mask(attention_mask, T), scale=attn.scaling
        )
        h1 = residual + attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        h2 = h1 + layer.mlp(layer.post_attention_layernorm(h1))
        return h.lm_head(h.norm(h2)), h.d2t, k, v


def _repeat_kv(x, s):
    n = s.num_attention_heads // s.num_key_value_heads
    B, H, S, D = x.shape
    return x[:, :, None].expand(B, H, n, S, D).reshape(B, H * n, S, D)


def _mask(attention_mask, T: int):
    """Additive [B, 1, T, S]: fed token i sees the kept slots up to its own (S - T + i)."""
    S = attention_mask.shape[1]
    pos = torch.arange(S)[None, :] <= (torch.arange(T)[:, None] + (S - T))
    allow = pos[None, None] & attention_mask.bool()[:, None, None, :]
    return torch.zeros(allow.shape).masked_fill(~allow, torch.finfo(torch.float32).min)


def draft_ir(head):
    """An ``ov.Model`` of ``head`` (an ``Eagle3Head``) in the draft layout GenAI's EAGLE-3 pipeline reads."""
    model = convert_head(head)
    _name_for_genai(model)
    _make_stateful(model)
    model.set_rt_info("True", ["eagle3_mode"])
    model.set_rt_info([i - 1 for i in head.shape.layers], ["hidden_layers_list"])  # decoder layers whose output is read
    return model


def convert_head(head):
    """``head`` converted with its KV cache as inputs ``past_key``/``past_value`` and outputs ``logits``, ``d2t``,
    ``present_key``, ``present_value`` (``draft_ir`` makes the cache a state)."""
    import openvino as ov

    s = head.shape
    graph = _DraftGraph(head.float().eval()).eval()
    kv = torch.zeros(1, s.num_key_value_heads, 2, s.head_dim)
    example = {
        "input_ids": torch.zeros(1, 3, dtype=torch.long),
        "hidden_states": torch.randn(1, 3, len(s.layers) * s.target_hidden_size),
        "attention_mask": torch.ones(1, 5, dtype=torch.long),
        "position_ids": torch.arange(2, 5)[None],
        "past_key": kv,
        "past_value": kv,
    }
    shapes = {
        "input_ids": [-1, -1],
        "hidden_states": [-1, -1, -1],
        "attention_mask": [-1, -1],
        "position_ids": [-1, -1],
        "past_key": [-1, s.num_key_value_heads, -1, s.head_dim],
        "past_value": [-1, s.num_key_value_heads, -1, s.head_dim],
    }
    with torch.no_grad():
        model = ov.convert_model(
            graph, example_input=example, input=[(k, ov.PartialShape(v)) for k, v in shapes.items()]
        )
    for out, name in zip(model.outputs, ("logits", "d2t", "present_key", "present_value")):
        out.get_tensor().set_names({name})
    return model


def _name_for_genai(model) -> None:
    """The friendly names GenAI looks for (module doc): the d2t constant, the embedding placeholder and
    the layer's last residual Add (the one adding the MLP's down projection, itself fed by a Multiply)."""
    d2t = model.output("d2t").get_node().input_value(0).get_node()
    d2t.set_friendly_name("d2t")
    adds = [op for op in model.get_ordered_ops() if op.get_type_name() == "Add" and _adds_mlp(op)]
    if len(adds) != 1:
        raise ConfigError(f"the EAGLE-3 draft graph has {len(adds)} MLP residual adds, not 1")
    adds[0].set_friendly_name("midlayer/mlp_residual_add")
    embedding_gather(model).input_value(0).get_node().set_friendly_name("embed_tokens.weight")


def embedding_gather(model):
    """The Gather of the draft's embedding placeholder (``_DraftGraph.embed_tokens``)."""
    return next(
        op
        for op in model.get_ordered_ops()
        if op.get_type_name() == "Gather" and "embed_tokens" in op.input_value(0).get_node().get_friendly_name()
    )


def _adds_mlp(op) -> bool:
    mm = op.input_value(1).get_node()
    return mm.get_type_name() == "MatMul" and mm.input_value(0).get_node().get_type_name() == "Multiply"


def _make_stateful(model) -> None:
    """The KV cache as state variables read through a ``beam_idx`` Gather, as GenAI's stateful LLM IRs hold it."""
    import openvino as ov
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation

    beam_idx = opset13.parameter(ov.PartialShape([-1]), ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    model.add_parameters([beam_idx])
    for name in ("past_key", "past_value"):
        port = model.input(name)
        consumers = port.get_target_inputs()
        gather = opset13.gather(port, beam_idx, opset13.constant(0))
        for consumer in consumers:
            consumer.replace_source_output(gather.output(0))
    model.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(model, {"past_key": "present_key", "past_value": "present_value"})
    # each state starts as an empty [batch, heads, 0, head_dim] (GenAI's paged-attention rewrite matches
    # a ReadValue with this initializer)
    ids_shape = opset13.shape_of(model.input("input_ids"), "i64")
    batch = opset13.gather(ids_shape, opset13.constant([0]), opset13.constant(0))
    for op in model.get_ops():
        if op.get_type_name() == "ReadValue":
            heads, dim = (op.get_output_partial_shape(0)[i].get_length() for i in (1, 3))
            shape = opset13.concat([batch, opset13.constant([heads, 0, dim], ov.Type.i64)], 0)
            op.set_arguments([opset13.broadcast(opset13.constant(0.0, ov.Type.f32), shape)])
    model.validate_nodes_and_infer_types()


# --- the two directories -------------------------------------------------------------------------
@dataclass(frozen=True)
class GenAIEagle3Dirs:
    main: Path  # LLMPipeline(main, ...)
    draft: Path  # draft_model(draft, ...)


def prepare(head_dir: str | Path, main_xml: Path, out: Path) -> GenAIEagle3Dirs:
    """The main and draft directories for ``head_dir`` and the target's IR ``main_xml``, under ``out``;
    made again only when either source changed (a stamp says from what)."""
    head_dir, out = Path(head_dir), Path(out)
    dirs = GenAIEagle3Dirs(out / "main", out / "draft")
    source = _source(head_dir, main_xml)
    stamp = out / STAMP
    if _stamped_source(stamp) == source:
        return dirs
    text, n_layers = _main_xml_for_genai(main_xml)
    head = _read_head(head_dir, n_layers, _vocab_of(main_xml))
    for d in (dirs.main, dirs.draft):
        d.mkdir(parents=True, exist_ok=True)
    (dirs.main / "openvino_model.xml").write_text(text)
    _link(main_xml.with_suffix(".bin"), dirs.main / "openvino_model.bin")
    for name in TOKENIZER_FILES + ("config.json", "generation_config.json"):
        if (main_xml.parent / name).is_file():
            _link(main_xml.parent / name, dirs.main / name)
    for name in TOKENIZER_FILES:  # GenAI reads a tokenizer from the draft's directory too
        if (main_xml.parent / name).is_file():
            _link(main_xml.parent / name, dirs.draft / name)
    import openvino as ov

    ov.save_model(draft_ir(head), dirs.draft / "openvino_model.xml")
    stamp.write_text(json.dumps({"source": source}))
    return dirs


def _stamped_source(stamp: Path) -> str | None:
    """What ``stamp`` says the directories were made from; None when absent or unreadable (made again)."""
    try:
        return json.loads(stamp.read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None


def cache_dir_for(head_dir: str | Path, main_xml: Path) -> str:
    """A directory name for ``prepare``'s output of this head and IR."""
    key = f"{Path(head_dir).resolve()} {Path(main_xml).resolve()}"
    return "eagle3-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _source(head_dir: Path, main_xml: Path) -> str:
    files = [
        head_dir / "config.json",
        *sorted(head_dir.glob("*.safetensors")),
        *sorted(head_dir.glob("*.bin")),
        main_xml,
        main_xml.with_suffix(".bin"),
    ]
    return " ".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files if f.is_file())


def _main_xml_for_genai(main_xml: Path) -> tuple[str, int]:
    """The IR's XML with its decoder layers' closing residual Adds named as GenAI looks for them, and the
    number of decoder layers."""
    if not main_xml.is_file():
        raise ConfigError(f"no OpenVINO IR at {main_xml}")
    text = main_xml.read_text()
    gguf_names = MAIN_ADD.findall(text)
    if gguf_names:
        return MAIN_ADD.sub(r'name="model.layers.\1/self_attn.add1"', text), len(gguf_names)
    layers = {int(i) for i in re.findall(r'name="[^"]*layers\.(\d+)/', text)}
    if not layers:
        raise ConfigError(
            f"{main_xml}: no decoder layers named as OpenVINO GenAI's EAGLE-3 pipeline finds them "
            "(optimum-intel's 'layers.N/' or GenAI's GGUF reader's 'model.layers.self_attn.add1.layerN')"
        )
    return text, max(layers) + 1


def _vocab_of(main_xml: Path) -> int:
    import openvino as ov

    logits = ov.Core().read_model(main_xml).output(0).get_partial_shape()
    return logits[2].get_length() if logits.rank.get_length() == 3 and logits[2].is_static else 0


def _read_head(head_dir: Path, n_layers: int, vocab: int):
    from ..models import head_formats
    from ..models.eagle3 import Eagle3Head

    cfg_path = head_dir / head_formats.CONFIG
    if not cfg_path.is_file():
        raise ConfigError(f"{head_dir} has no {head_formats.CONFIG}: not an EAGLE-3 head directory")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise ConfigError(f"{cfg_path} is not JSON: {e}") from None
    ck = head_formats.read(head_dir, cfg, n_layers)
    if vocab and ck.shape.vocab_size != vocab:
        raise ConfigError(
            f"head {head_dir} was made for a vocabulary of {ck.shape.vocab_size}; the target's IR has {vocab}"
        )
    head = Eagle3Head(ck.shape)
    head.load_state_dict(ck.state)
    return head


def _link(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    os.symlink(src.resolve(), dst)
