"""EAGLE-3 checkpoints in the three formats users have, read into one ``Eagle3Checkpoint``; ours written
in the reference layout that the other engines read.

- ``specforge``: the EAGLE repository's and SpecForge's (SGLang's) ``config.json`` with architecture
  ``LlamaForCausalLMEagle3``, the Llama fields at the top level, ``draft_vocab_size``, optionally
  ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang's convention:
  the decoder layer whose OUTPUT is taken, i.e. hidden-states index - 1); tensors ``midlayer.*``.
- ``vllm``: architecture ``Eagle3LlamaForCausalLM``; a top-level ``eagle_aux_hidden_state_layer_ids``
  in vLLM's convention (hidden-states index: the layer whose INPUT is taken); tensors ``midlayer.*``
  or ``layers.0.*``, possibly under ``model.``.
- ``speculators``: ``speculators_model_type: eagle3`` (architecture ``Eagle3Speculator``), the layer's
  fields under ``transformer_layer_config``, top-level ``draft_vocab_size``, ``norm_before_residual``,
  ``target_hidden_size`` and ``eagle_aux_hidden_state_layer_ids`` (vLLM's convention); tensors
  ``layers.0.*``, ``fc`` possibly with a bias.

Weights come from ``model.safetensors`` or ``pytorch_model.bin``; the latter is read with torch's
weights-only unpickler, which builds tensors and plain values and runs no code from the file. A copy of
the target's embedding (``embed_tokens``) is ignored: the target's own is used.

What we write (``write``) is the ``specforge`` layout plus the top-level vLLM ids, so SGLang, vLLM and
SpecForge read it as it is, with a ``specdraft`` section (head type, the target it was trained for and
its fingerprint, the aux layers as hidden-states indices, training facts) that the others ignore.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..core.errors import ConfigError
from .base import ModelFacts
from .eagle3 import Eagle3Shape, eagle3_layers

FORMATS = ("specforge", "vllm", "speculators")
ARCHITECTURE = {
    "specforge": "LlamaForCausalLMEagle3",
    "vllm": "Eagle3LlamaForCausalLM",
    "speculators": "Eagle3Speculator",
}
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
INT8_SCALE = ".int8_scale"  # our compact storage: int8 rows with a float32 scale each (``storage: int8``)


@dataclass
class Eagle3Checkpoint:
    shape: Eagle3Shape
    state: dict[str, torch.Tensor]  # reference names (models/eagle3.py), dequantized
    format: str
    meta: dict = field(default_factory=dict)  # the ``specdraft`` section (empty for others' checkpoints)


def is_eagle3_config(cfg) -> bool:
    return isinstance(cfg, dict) and (
        cfg.get("speculators_model_type") == "eagle3" or bool(set(_archs(cfg)) & set(ARCHITECTURE.values()))
    )


def _archs(cfg: dict) -> list:
    a = cfg.get("architectures")
    return [x for x in a if isinstance(x, str)] if isinstance(a, list) else []


def detect_format(cfg: dict) -> str:
    if cfg.get("speculators_model_type") == "eagle3" or "Eagle3Speculator" in _archs(cfg):
        return "speculators"
    if "Eagle3LlamaForCausalLM" in _archs(cfg):
        return "vllm"
    if "LlamaForCausalLMEagle3" in _archs(cfg):
        return "specforge"
    raise ConfigError(
        "not an EAGLE-3 config: need architectures LlamaForCausalLMEagle3 (SpecForge, EAGLE), "
        "Eagle3LlamaForCausalLM (vLLM) or speculators_model_type eagle3"
    )


# --- reading -------------------------------------------------------------------------------------
def read(path: str | Path, cfg: dict, target_layers: int, target: ModelFacts | None = None) -> Eagle3Checkpoint:
    """The checkpoint in directory ``path`` (its parsed ``cfg``), for a target of ``target_layers`` layers
    (and, where given, the ``target``'s facts). Checkpoints come from others: every config field is bounded
    and checked against the target and the weights' shapes before anything is sized by it."""
    fmt = detect_format(cfg)
    shape = _shape(cfg, fmt, target_layers, Path(path) / CONFIG)
    if target is not None:
        for what, theirs, ours in (
            ("target hidden size", shape.target_hidden_size, target.hidden_size),
            ("vocabulary", shape.vocab_size, target.vocab_size),
        ):
            if theirs != ours:
                raise ConfigError(f"head {path} was made for a target with {what} {theirs}; this target has {ours}")
    state = _normalized(_load_tensors(Path(path)), Path(path))
    shape = replace(shape, fc_bias="fc.bias" in state)
    check_state(state, shape, str(path), vocab_maps=False)  # before d2t / t2d are made at their config's sizes
    meta = cfg.get("specdraft") if isinstance(cfg.get("specdraft"), dict) else {}
    state = _with_vocab_maps(state, shape, path)
    check_state(state, shape, str(path))
    return Eagle3Checkpoint(shape, state, fmt, meta)


# Bounds on a config's sizes, far above any model's (vocabularies reach ~260k, hidden sizes ~16k): a size
# past one is a damaged or hostile file, refused before a tensor is allocated by it.
MAX_SIZE = {"vocab_size": 1 << 22, "draft_vocab_size": 1 << 22, "intermediate_size": 1 << 18}
MAX_OTHER = 1 << 16  # hidden sizes, head counts and widths
MAX_POSITIONS = 1 << 24


def _num(d: dict, key: str, kind, where, default=None):
    """A positive number (an integer where ``kind`` is int) no larger than its bound; one error naming the key."""
    v = d.get(key, default)
    kind_ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    bound = MAX_SIZE.get(key, MAX_POSITIONS if key == "max_position_embeddings" else MAX_OTHER)
    if kind is int:
        ok = kind_ok and (isinstance(v, int) or (math.isfinite(v) and float(v).is_integer())) and 0 < v <= bound
        if not ok:
            raise ConfigError(f"{where}: {key} must be an integer from 1 to {bound}, got {_short(v)}")
        return int(v)
    ok = kind_ok and (abs(v) < 1e300 if isinstance(v, int) else math.isfinite(v)) and 0 < v < 1e300
    if not ok:
        raise ConfigError(f"{where}: {key} must be a finite positive number, got {_short(v)}")
    return float(v)


def _short(v) -> str:
    """A config value for an error line: a 400-digit number as its first digits and its length."""
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


def _shape(cfg: dict, fmt: str, target_layers: int, where) -> Eagle3Shape:
    layer = cfg.get("transformer_layer_config") if fmt == "speculators" else cfg
    if not isinstance(layer, dict):
        raise ConfigError(f"{where}: transformer_layer_config must be an object")
    H = _num(layer, "hidden_size", int, where)
    heads = _num(layer, "num_attention_heads", int, where)
    rope = layer.get("rope_parameters") if isinstance(layer.get("rope_parameters"), dict) else {}
    vocab = _num(layer, "vocab_size", int, where)
    kv = _num(layer, "num_key_value_heads", int, where, heads)
    if heads % kv:  # grouped-query attention shares each key/value head among heads // kv query heads
        raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    return Eagle3Shape(
        hidden_size=H,
        target_hidden_size=_num(cfg, "target_hidden_size", int, where, H)
        if cfg.get("target_hidden_size") is not None
        else H,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=_num(layer, "head_dim", int, where, H // heads) if layer.get("head_dim") is not None else H // heads,
        intermediate_size=_num(layer, "intermediate_size", int, where),
        rms_norm_eps=_num(layer, "rms_norm_eps", float, where, 1e-6),
        rope_theta=_num(
            {"rope_theta": rope.get("rope_theta", layer.get("rope_theta", 10000.0))}, "rope_theta", float, where
        ),
        max_position_embeddings=_num(layer, "max_position_embeddings", int, where, 4096),
        vocab_size=vocab,
        draft_vocab_size=_num(cfg, "draft_vocab_size", int, where, vocab),
        layers=_aux_layers(cfg, fmt, target_layers, where),
        norm_before_residual=cfg.get("norm_before_residual") is True,
        fc_bias=False,
    )


def _aux_layers(cfg: dict, fmt: str, target_layers: int, where) -> tuple[int, ...]:
    """Hidden-states indices of the three aux layers (module doc: each format's convention)."""
    own = cfg.get("specdraft", {}).get("aux_layers") if isinstance(cfg.get("specdraft"), dict) else None
    eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    if own is not None:
        ids, shift = own, 0
    elif cfg.get("eagle_aux_hidden_state_layer_ids") is not None:
        ids, shift = cfg["eagle_aux_hidden_state_layer_ids"], 0
    elif fmt == "specforge" and eagle.get("eagle_aux_hidden_state_layer_ids") is not None:
        ids, shift = eagle["eagle_aux_hidden_state_layer_ids"], 1
    else:
        return eagle3_layers(target_layers)
    if not (
        isinstance(ids, list) and len(ids) == 3 and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise ConfigError(f"{where}: the aux layer ids must be a list of 3 integers, got {ids!r}")
    out = tuple(i + shift for i in ids)
    bad = [i for i in out if not 1 <= i <= target_layers]
    if bad:
        raise ConfigError(
            f"{where}: aux layers {list(out)} (hidden-states indices) name layers this target of "
            f"{target_layers} layers does not have"
        )
    return out


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    st, pt = path / WEIGHTS, path / "pytorch_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(str(st))
        if pt.is_file():  # weights-only: no code from the file runs (module doc)
            obj = torch.load(pt, map_location="cpu", weights_only=True)
            if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
                raise ConfigError(f"{pt} does not hold a dict of tensors")
            return obj
    except ConfigError:
        raise
    except Exception as e:  # a truncated or foreign file: safetensors and torch raise many kinds
        raise ConfigError(
            f"the weights of {path} cannot be read: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    raise ConfigError(f"{path} has no {WEIGHTS} or pytorch_model.bin")


def _normalized(state: dict, path: Path) -> dict[str, torch.Tensor]:
    """Reference names: ``model.`` and ``layers.0.`` prefixes mapped to ``midlayer.``, our int8 rows
    dequantized, the embedding copy dropped."""
    scales = {k[: -len(INT8_SCALE)]: v for k, v in state.items() if k.endswith(INT8_SCALE)}
    out = {}
    for k, v in state.items():
        if k.endswith(INT8_SCALE):
            continue
        if k in scales:
            sc = scales[k]
            if v.dim() != 2 or tuple(sc.shape) != (v.shape[0],) or not sc.is_floating_point():
                raise ConfigError(
                    f"{path}: {k}{INT8_SCALE} must hold one float scale per row of {k} "
                    f"({v.shape[0] if v.dim() else 'a 0-d tensor has no rows'}), got shape {list(sc.shape)} {sc.dtype}"
                )
            v = v.float() * sc.float()[:, None]
        name = k[len("model.") :] if k.startswith("model.") else k
        name = "midlayer." + name[len("layers.0.") :] if name.startswith("layers.0.") else name
        if name.startswith("embed_tokens.") or name == "mask_hidden":
            continue
        out[name] = v
    return out


def _with_vocab_maps(state: dict, shape: Eagle3Shape, path) -> dict:
    """d2t / t2d made when absent (a full draft vocabulary) and checked against each other."""
    if "d2t" not in state:
        if shape.draft_vocab_size != shape.vocab_size:
            raise ConfigError(
                f"{path}: d2t is missing but the draft vocabulary ({shape.draft_vocab_size}) is "
                f"smaller than the target's ({shape.vocab_size})"
            )
        state["d2t"] = torch.zeros(shape.draft_vocab_size, dtype=torch.long)
    d2t = state["d2t"]
    if d2t.dim() != 1 or d2t.numel() != shape.draft_vocab_size or d2t.is_floating_point():
        raise ConfigError(
            f"{path}: d2t must hold {shape.draft_vocab_size} integer offsets, got {tuple(d2t.shape)} {d2t.dtype}"
        )
    ids = torch.arange(d2t.numel()) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= shape.vocab_size:
        raise ConfigError(
            f"{path}: d2t maps draft tokens to ids outside the target's vocabulary of "
            f"{shape.vocab_size} (from {int(ids.min())} to {int(ids.max())})"
        )
    if "t2d" not in state:
        t2d = torch.zeros(shape.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
    state["d2t"] = d2t.long()
    state["t2d"] = state["t2d"].bool()
    return state


def expected_shapes(shape: Eagle3Shape) -> dict[str, tuple[int, ...]]:
    H, inter, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d
    out = {
        "fc.weight": (H, len(shape.layers) * shape.target_hidden_size),
        "norm.weight": (H,),
        "lm_head.weight": (shape.draft_vocab_size, H),
        "d2t": (shape.draft_vocab_size,),
        "t2d": (shape.vocab_size,),
    }
    m = "midlayer."
    out.update(
        {
            m + "input_layernorm.weight": (H,),
            m + "hidden_norm.weight": (H,),
            m + "post_attention_layernorm.weight": (H,),
            m + "self_attn.q_proj.weight": (q, 2 * H),
            m + "self_attn.k_proj.weight": (kv, 2 * H),
            m + "self_attn.v_proj.weight": (kv, 2 * H),
            m + "self_attn.o_proj.weight": (H, q),
            m + "mlp.gate_proj.weight": (inter, H),
            m + "mlp.up_proj.weight": (inter, H),
            m + "mlp.down_proj.weight": (H, inter),
        }
    )
    if shape.fc_bias:
        out["fc.bias"] = (H,)
    return out


def check_state(state: dict, shape: Eagle3Shape, where: str, vocab_maps: bool = True) -> None:
    """Every tensor the shape needs, at its size; a foreign tensor is named (one message). ``vocab_maps``
    False: d2t and t2d are checked only where present (before _with_vocab_maps makes the missing ones)."""
    want = expected_shapes(shape)
    if not vocab_maps:
        want = {k: v for k, v in want.items() if k not in ("d2t", "t2d") or k in state}
    missing = sorted(set(want) - set(state))
    if missing:
        raise ConfigError(
            f"{where}: the EAGLE-3 checkpoint lacks {', '.join(missing[:4])}{' and more' if len(missing) > 4 else ''}"
        )
    extra = sorted(set(state) - set(want))
    if extra:
        raise ConfigError(
            f"{where}: the EAGLE-3 checkpoint has tensors this layout does not know: "
            f"{', '.join(extra[:4])}{' and more' if len(extra) > 4 else ''}"
        )
    for k, s in want.items():
        if tuple(state[k].shape) != s:
            raise ConfigError(f"{where}: {k} has shape {list(state[k].shape)}, its config needs {list(s)}")


# --- writing -------------------------------------------------------------------------------------
def config_dict(shape: Eagle3Shape, fmt: str = "specforge", meta: dict | None = None, dtype: str = "bfloat16") -> dict:
    """config.json of ``fmt``; ``meta`` becomes the ``specdraft`` section."""
    layer = {
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": shape.max_position_embeddings,
        "vocab_size": shape.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    vllm_ids = list(shape.layers)
    if fmt == "speculators":
        cfg = {
            "architectures": [ARCHITECTURE[fmt]],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "draft_vocab_size": shape.draft_vocab_size,
            "norm_before_residual": shape.norm_before_residual,
            "target_hidden_size": shape.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": vllm_ids,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": (meta or {}).get("target")},
            },
        }
    else:
        cfg = {
            "architectures": [ARCHITECTURE[fmt]],
            **layer,
            "draft_vocab_size": shape.draft_vocab_size,
            "eagle_aux_hidden_state_layer_ids": vllm_ids,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in vllm_ids],
                "use_aux_hidden_state": True,
            },
        }
        if shape.target_hidden_size != shape.hidden_size:
            cfg["target_hidden_size"] = shape.target_hidden_size
        if shape.norm_before_residual:
            cfg["norm_before_residual"] = True
    if meta:
        cfg["specdraft"] = {**meta, "aux_layers": vllm_ids}
    return cfg


def write(
    out: str | Path,
    shape: Eagle3Shape,
    state: dict,
    meta: dict | None = None,
    fmt: str = "specforge",
    dtype: torch.dtype = torch.bfloat16,
    int8: bool = False,
) -> None:
    """A checkpoint directory of ``fmt`` (weights in ``dtype``; d2t and t2d as they are), each file
    written whole then renamed into place, the config last: a reader never meets half a head.
    ``int8``: our compact storage (the large matrices as int8 rows with a scale each; only specdraft
    reads it, ``specdraft heads export`` writes the others' dtype)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    check_state(state, shape, str(out))
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    tensors = {}
    for k, v in state.items():
        name = prefix + k[len("midlayer.") :] if k.startswith("midlayer.") else k
        tensors[name] = (
            v.detach().to("cpu").contiguous() if k in ("d2t", "t2d") else v.detach().to("cpu", dtype).contiguous()
        )
    if int8:
        tensors = int8_rows(tensors)
        meta = {**(meta or {}), "storage": "int8"}
    tmp = out / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, out / WEIGHTS)
    name = str(dtype).replace("torch.", "")
    text = json.dumps(config_dict(shape, fmt, meta, name), indent=2)
    (out / (CONFIG + ".tmp")).write_text(text)
    os.replace(out / (CONFIG + ".tmp"), out / CONFIG)


def int8_rows(state: dict) -> dict:
    """Matrices of 64k entries or more as int8 with a float32 scale per row (symmetric); the rest as given."""
    out = {}
    for k, v in state.items():
        if v.is_floating_point() and v.dim() == 2 and v.numel() >= 1 << 16:
            scale = v.float().abs().amax(1).clamp(min=1e-12) / 127
            out[k] = torch.round(v.float() / scale[:, None]).to(torch.int8)
            out[k + INT8_SCALE] = scale
        else:
            out[k] = v
    return out
