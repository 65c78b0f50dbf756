"""Trained draft heads on the target's own features: Medusa and EAGLE.

Both read the target's *feature*: the last hidden state after the final norm, i.e. the input of
the LM head (``HFModel`` captures it with a forward hook on the final norm when a drafter asks).
Both reuse the target's frozen embedding and LM head; only the head's own weights are trained
(``specdraft train``, specdraft/commands/train/) and saved.

- ``MedusaHeads`` (Medusa-1): K heads, head i = ``n_blocks`` residual blocks h + SiLU(W h) on the
  feature f_t, then the target's LM head; head i predicts the token at offset i + 2 from the
  position whose feature it reads (the LM head itself predicts offset 1).
- ``EagleHead`` (EAGLE-1): ``fc(concat(f_t, embed(x_{t+1})))`` -> one stock Llama decoder layer of
  the target's attention and MLP shape (its ``ModelFacts``; no forked modeling code) -> the predicted
  feature f_{t+1}; the target's LM head on it predicts x_{t+2}. Autoregressive on features with its
  own KV cache. Optionally a reduced draft vocabulary (``draft_ids``: the most frequent training
  tokens); the draft's distribution is then 0 outside those ids.
- EAGLE-3 heads (models/eagle3.py) read three target layers instead and have their own LM head; their
  checkpoints are the reference layout (models/head_formats.py).

Heads touch the target only through the model interface (``facts``, ``embed``, ``output_rows``, the
features of ``forward(hidden=True)``), so any backend with ``capabilities.head_io`` runs them.

A Medusa or EAGLE head directory holds ``head.safetensors`` and ``config.json`` (type, target,
dimensions, a fingerprint of the target, step, training command); an EAGLE-3 head directory is a
checkpoint of SpecForge, vLLM or speculators (``config.json`` + ``model.safetensors``). ``load_head``
checks either against the target and names any mismatch.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch
from torch import nn

from ..core.device import HOST
from ..core.errors import ConfigError
from ..core.homefiles import ANY, NUMBER, Schema, nullable, obj, of
from ..core.jsonl import read_json_file

HEAD_TYPES = ("medusa", "eagle", "eagle3")


# --- what a head must match --------------------------------------------------------------------
def target_signature(target) -> dict:
    """What a head must match: architecture facts plus a weight fingerprint of the LM head (a sum over a
    few rows, compared with a relative tolerance so a bf16 or 4-bit copy of the same target passes)."""
    f = target.facts
    w = target.output_rows(torch.arange(min(64, target.vocab_size), device=HOST))
    return {
        "model_type": f.model_type,
        "hidden_size": f.hidden_size,
        "vocab_size": f.vocab_size,
        "num_hidden_layers": f.num_layers,
        "lm_head_fingerprint": float(w.detach().double().abs().sum()),
    }


FINGERPRINT_TOLERANCE = 2e-2  # relative: a Q4_0 copy's rows differ from the dense weights' by ~0.3% here


def check_signature(saved: dict, target, where: str, trained_for=None) -> None:
    """``saved``: the signature recorded when the head was trained for ``trained_for`` (a target name)."""
    now = target_signature(target)
    for key in ("model_type", "hidden_size", "vocab_size", "num_hidden_layers"):
        if saved.get(key) != now[key]:
            raise ConfigError(
                f"head {where} was trained for a target with {key}={saved.get(key)!r} "
                f"(target {trained_for!r}); this target has {key}={now[key]!r}"
            )
    a, b = saved.get("lm_head_fingerprint"), now["lm_head_fingerprint"]
    if not isinstance(a, (int, float)) or abs(a - b) > FINGERPRINT_TOLERANCE * max(abs(a), abs(b), 1e-6):
        raise ConfigError(
            f"head {where} was trained for target {trained_for!r}, whose LM head weights "
            f"differ from this target's (fingerprint {a} vs {b}): a head only fits the model it was "
            "trained on"
        )


def needs_head_io(target, what: str) -> None:
    if not target.capabilities.head_io:
        raise ConfigError(
            f"{what} needs the target's embedding and LM head, which {target.name} on the "
            f"{target.backend} backend does not offer"
        )


# --- Medusa ----------------------------------------------------------------------------------
class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # start as the identity: head i begins as the LM head itself
        nn.init.zeros_(self.linear.bias)

    def forward(self, x):
        return x + torch.nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden: int, n_heads: int, n_blocks: int = 1):
        super().__init__()
        self.hidden, self.n_heads, self.n_blocks = hidden, n_heads, n_blocks
        self.heads = nn.ModuleList(nn.Sequential(*[ResBlock(hidden) for _ in range(n_blocks)]) for _ in range(n_heads))

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [..., H] -> per-head features [..., K, H] (the LM head turns them into logits)."""
        return torch.stack([h(feats) for h in self.heads], dim=-2)

    def meta(self) -> dict:
        return {"type": "medusa", "hidden_size": self.hidden, "heads": self.n_heads, "blocks": self.n_blocks}


# --- EAGLE -----------------------------------------------------------------------------------
def one_layer_config(facts):
    """A one-layer Llama config of the target's attention and MLP shape (EAGLE-1's decoder layer)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=1,
        hidden_size=facts.hidden_size,
        intermediate_size=facts.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=facts.num_attention_heads,
        num_key_value_heads=facts.num_key_value_heads,
        head_dim=facts.head_dim,
        rms_norm_eps=facts.rms_norm_eps,
        max_position_embeddings=facts.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": facts.rope_theta},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


class EagleHead(nn.Module):
    def __init__(self, facts, draft_ids: torch.Tensor | None = None):
        super().__init__()
        from transformers import AutoModel

        self.cfg = one_layer_config(facts)
        h = int(self.cfg.hidden_size)
        self.hidden = h
        self.fc = nn.Linear(2 * h, h)
        body = AutoModel.from_config(self.cfg)
        if not isinstance(getattr(body, "layers", None), nn.ModuleList):
            raise ConfigError(f"{type(body).__name__} has no layers ModuleList; EAGLE needs a decoder-only LM")
        body.norm = nn.Identity()  # EAGLE-1: the predicted feature goes straight to the LM head
        self.body = body
        params = inspect.signature(body.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.register_buffer(
            "draft_ids", draft_ids if draft_ids is not None else torch.empty(0, dtype=torch.long), persistent=True
        )

    def forward(self, feats, tok_emb, cache=None, position_ids=None, attention_mask=None):
        """feats, tok_emb [B, T, H] (f_t and embed(x_{t+1})) -> predicted features [B, T, H]."""
        x = self.fc(torch.cat([feats, tok_emb], dim=-1))
        kw = {} if cache is None else {self._cache_kw: cache, "use_cache": True}
        out = self.body(inputs_embeds=x, position_ids=position_ids, attention_mask=attention_mask, **kw)
        return out.last_hidden_state

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.cfg)

    def meta(self) -> dict:
        return {"type": "eagle", "hidden_size": self.hidden, "draft_vocab": int(self.draft_ids.numel()) or None}


# --- saving and loading ----------------------------------------------------------------------
def save_head(head: nn.Module, out: Path, extra: dict) -> None:
    """A Medusa or EAGLE head: head.safetensors, then config.json (type, dimensions, ``extra``), each
    written whole and renamed into place. (EAGLE-3 heads: ``head_formats.write``.)"""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous().clone() for k, v in head.state_dict().items()}
    tmp = out / "head.safetensors.tmp"
    save_file(state, str(tmp))
    tmp.replace(out / "head.safetensors")
    meta = {**head.meta(), **extra}
    (out / "config.tmp").write_text(json.dumps(meta, indent=2))
    (out / "config.tmp").replace(out / "config.json")


def _int_at_least(low: int) -> Schema:
    return of(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low, f"an integer >= {low}")


_COUNT = _int_at_least(1)
_COMMON = {
    "hidden_size": _COUNT,
    "train_s": nullable(NUMBER),
    "target_signature": obj({"lm_head_fingerprint": nullable(NUMBER)}, keys=ANY),
}
HEAD_SCHEMAS = {  # what building and loading a head reads of its config.json (training writes more)
    "medusa": obj({**_COMMON, "heads": _COUNT, "blocks": _COUNT}, required=("hidden_size", "heads"), keys=ANY),
    "eagle": obj({**_COMMON, "draft_vocab": nullable(_COUNT)}, required=("hidden_size",), keys=ANY),
}  # (EAGLE-3 checkpoints: head_formats checks theirs)


def read_head_config(path: str | Path, expect_type: str | None = None) -> dict:
    """The head directory's config.json, checked (every field building and loading the head reads), with
    its ``type``; ``expect_type``: the head type the method needs. An EAGLE-3 checkpoint of any format
    (models/head_formats.py) is type eagle3; its fields are checked when it is read. Called on load
    (``load_head``), by ``train --resume`` and by the CLI before it loads any model;
    ``SpecConfig.validate`` reads no files."""
    from .head_formats import is_eagle3_config

    p = Path(path)
    if not p.is_dir():
        raise ConfigError(
            f"head directory {str(p)!r} not found (train one with `specdraft train medusa|eagle|eagle3 "
            "--target NAME -o DIR`)"
        )
    cf = p / "config.json"
    if not cf.is_file():
        raise ConfigError(
            f"{p} is not a head directory: it needs config.json (written by `specdraft train`, or an "
            "EAGLE-3 checkpoint of SpecForge, vLLM or speculators)"
        )
    try:
        meta = read_json_file(cf)
    except ValueError as e:
        raise ConfigError(f"{cf}: {e}") from None
    if is_eagle3_config(meta):
        meta = {**meta, "type": "eagle3"}
    elif not isinstance(meta, dict) or meta.get("type") not in HEAD_SCHEMAS:
        raise ConfigError(
            f"{cf} has no valid head type (need 'type': one of {', '.join(HEAD_SCHEMAS)}, or an "
            "EAGLE-3 checkpoint's architectures)"
        )
    else:
        problem = HEAD_SCHEMAS[meta["type"]](meta, "")
        if problem:
            raise ConfigError(f"{cf}: {problem} (not a config `specdraft train` wrote)")
    if expect_type is not None and meta["type"] != expect_type:
        raise ConfigError(f"head {path} is a {meta['type']} head; method {expect_type!r} needs a {expect_type} head")
    return meta


def build_head(meta: dict, target) -> nn.Module:
    """A Medusa or EAGLE head of ``meta``'s shape (read_head_config's) for ``target``, weights not loaded yet."""
    H = target.facts.hidden_size
    if meta["hidden_size"] != H:
        raise ConfigError(f"the head has hidden_size {meta['hidden_size']}; this target has {H}")
    if meta["type"] == "medusa":
        return MedusaHeads(H, meta["heads"], meta.get("blocks", 1))
    n = meta.get("draft_vocab")
    return EagleHead(target.facts, torch.zeros(n, dtype=torch.long) if n else None)


def load_weights(head: nn.Module, state: dict, vocab_size: int, where: str) -> None:
    """``state`` into ``head``; a ConfigError if it does not fit, or its draft vocabulary is not
    distinct ids, ascending, of the target's vocabulary (``vocab_size``: the drafters index with them)."""
    try:
        head.load_state_dict(state)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ConfigError(f"head weights in {where} do not match its config.json: {str(e).splitlines()[0]}") from None
    ids = getattr(head, "draft_ids", torch.empty(0))
    if ids.numel() and not (ids[0] >= 0 and ids[-1] < vocab_size and bool((ids[1:] > ids[:-1]).all())):
        raise ConfigError(f"the draft vocabulary in {where} is not ascending ids of the target's {vocab_size} tokens")


def read_head_weights(path: Path) -> dict:
    """head.safetensors' tensors; a ConfigError for a file that is not one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    f = Path(path) / "head.safetensors"
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, RuntimeError, IndexError) as e:  # not ours: torn, another format
        raise ConfigError(f"{f} holds no head weights this program wrote ({str(e).splitlines()[0]})") from None


def head_dtype(target) -> torch.dtype:
    """The dtype a head runs in: the target's own on transformers; on a GGUF backend (float32 logits over
    4-bit weights) bf16 where the CPU multiplies it natively (a draft token of the Qwen 1.5B head: 4.7 ms of
    one core's time against 7.2 ms in float32, AMD EPYC Zen 4), float32 elsewhere."""
    from .llama_probe import native_bf16

    if target.backend != "hf" and target.dtype == torch.float32 and native_bf16():
        return torch.bfloat16
    return target.dtype


def load_head(path: str | Path, target, expect_type: str | None = None) -> tuple[nn.Module, dict]:
    """Load the head in ``path`` for ``target`` (checked to fit it, and to be the model it was trained on
    where the head records that), frozen, in the target's dtype, on the device of its features."""
    meta = read_head_config(path, expect_type)
    needs_head_io(target, f"a {meta['type']} head")
    if meta["type"] == "eagle3":
        head = _load_eagle3(path, meta, target)
    else:
        check_signature(meta.get("target_signature", {}), target, str(path), meta.get("target"))
        head = build_head(meta, target)
        load_weights(head, read_head_weights(path), target.vocab_size, str(path))
    head = head.to(device=target.device, dtype=head_dtype(target)).eval()
    for p in head.parameters():
        p.requires_grad_(False)
    return head, meta


def _load_eagle3(path, meta: dict, target) -> nn.Module:
    """An EAGLE-3 checkpoint of any of the three formats, checked against the target's facts (and its
    fingerprint, for heads trained here)."""
    from .eagle3 import Eagle3Head
    from .head_formats import read

    ck = read(path, meta, target.facts.num_layers, target.facts)
    if ck.meta.get("target_signature"):
        check_signature(ck.meta["target_signature"], target, str(path), ck.meta.get("target"))
    head = Eagle3Head(ck.shape)
    head.load_state_dict(ck.state)
    head.meta = {**ck.meta, "format": ck.format}
    return head
