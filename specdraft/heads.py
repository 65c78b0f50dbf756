"""Trained draft heads on the target's own features: Medusa and EAGLE.

Both read the target's *feature*: the last hidden state after the final norm, i.e. the input of
the LM head (``HFModel`` captures it with a forward hook on the final norm when a drafter asks).
Both reuse the target's frozen embedding and LM head; only the head's own weights are trained
(``specdraft train``, specdraft/train.py) and saved.

- ``MedusaHeads`` (Medusa-1): K heads, head i = ``n_blocks`` residual blocks h + SiLU(W h) on the
  feature f_t, then the target's LM head; head i predicts the token at offset i + 2 from the
  position whose feature it reads (the LM head itself predicts offset 1).
- ``EagleHead`` (EAGLE-1): ``fc(concat(f_t, embed(x_{t+1})))`` -> one decoder layer of the target's
  own transformers class (built from its config with num_hidden_layers=1; no forked modeling code)
  -> the predicted feature f_{t+1}; the target's LM head on it predicts x_{t+2}. Autoregressive on
  features with its own KV cache. Optionally a reduced draft vocabulary (``draft_ids``: the most
  frequent training tokens); the draft's distribution is then 0 outside those ids.

A head directory holds ``head.safetensors`` (the head's weights, plus ``draft_ids`` for a reduced
vocabulary) and ``config.json`` (type, target, dimensions, a fingerprint of the target, step,
training command); ``load_head`` checks it against the target and names any mismatch.
"""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path

import torch
from torch import nn

from .errors import ConfigError

HEAD_TYPES = ("medusa", "eagle")


# --- the target's pieces the heads share -----------------------------------------------------
def lm_head_of(target) -> nn.Module:
    return target.model.get_output_embeddings()


def embed_of(target) -> nn.Module:
    return target.model.get_input_embeddings()


def target_signature(target) -> dict:
    """What a head must match: architecture facts plus a weight fingerprint of the LM head (a sum
    over a few rows, compared with a relative tolerance so a bf16 copy of the same target passes)."""
    cfg = target.config
    w = lm_head_of(target).weight
    return {
        "model_type": getattr(cfg, "model_type", None),
        "hidden_size": int(cfg.hidden_size),
        "vocab_size": int(w.shape[0]),
        "num_hidden_layers": int(cfg.num_hidden_layers),
        "lm_head_fingerprint": float(w[:64].detach().double().abs().sum()),
    }


def check_signature(saved: dict, target, where: str) -> None:
    now = target_signature(target)
    for key in ("model_type", "hidden_size", "vocab_size", "num_hidden_layers"):
        if saved.get(key) != now[key]:
            raise ConfigError(f"head {where} was trained for a target with {key}={saved.get(key)!r} "
                              f"(target {saved.get('target')!r}); this target has {key}={now[key]!r}")
    a, b = saved.get("lm_head_fingerprint"), now["lm_head_fingerprint"]
    if a is None or abs(a - b) > 1e-2 * max(abs(a), abs(b), 1e-6):
        raise ConfigError(f"head {where} was trained for target {saved.get('target')!r}, whose LM head weights "
                          f"differ from this target's (fingerprint {a} vs {b}): a head only fits the model it was "
                          "trained on")


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
def one_layer_config(target_config):
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = 1
    cfg.pad_token_id = None
    cfg.vocab_size = 1  # the decoder's own embedding is never used (inputs_embeds); keep it tiny
    lt = getattr(cfg, "layer_types", None)
    if isinstance(lt, (list, tuple)) and lt:
        cfg.layer_types = list(lt[:1])
    return cfg


class EagleHead(nn.Module):
    def __init__(self, target_config, draft_ids: torch.Tensor | None = None):
        super().__init__()
        from transformers import AutoModel

        self.cfg = one_layer_config(target_config)
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
        self.register_buffer("draft_ids", draft_ids if draft_ids is not None else torch.empty(0, dtype=torch.long),
                             persistent=True)

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
        return {"type": "eagle", "hidden_size": self.hidden,
                "draft_vocab": int(self.draft_ids.numel()) or None}


# --- saving and loading ----------------------------------------------------------------------
def save_head(head: nn.Module, out: Path, extra: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in head.state_dict().items()}
    tmp = out / "head.safetensors.tmp"
    save_file(state, str(tmp))
    tmp.replace(out / "head.safetensors")
    meta = {**head.meta(), **extra}
    (out / "config.tmp").write_text(json.dumps(meta, indent=2))
    (out / "config.tmp").replace(out / "config.json")


def read_head_config(path: str | Path, expect_type: str | None = None) -> dict:
    """The head directory's config.json, checked; ``expect_type``: the method that will use it (a
    medusa head for method medusa, ...). Called on load (``load_head``) and by the CLI before it loads
    any model; ``SpecConfig.validate`` reads no files."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"head directory {str(p)!r} not found (train one with `specdraft train medusa|eagle "
                          "--target NAME --data PROMPTS.jsonl -o DIR`)")
    cf = p / "config.json"
    if not cf.exists() or not (p / "head.safetensors").exists():
        raise ConfigError(f"{p} is not a head directory: it needs config.json and head.safetensors "
                          "(written by `specdraft train`)")
    try:
        meta = json.loads(cf.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cf} is not valid JSON: {e}") from e
    if not isinstance(meta, dict) or meta.get("type") not in HEAD_TYPES:
        raise ConfigError(f"{cf} has no valid head type (need 'type': one of {', '.join(HEAD_TYPES)})")
    if expect_type is not None and meta["type"] != expect_type:
        raise ConfigError(f"head {path} is a {meta['type']} head; method {expect_type!r} needs a {expect_type} head")
    return meta


def build_head(meta: dict, target) -> nn.Module:
    if meta["type"] == "medusa":
        return MedusaHeads(int(meta["hidden_size"]), int(meta["heads"]), int(meta.get("blocks", 1)))
    n = meta.get("draft_vocab")
    ids = torch.zeros(int(n), dtype=torch.long) if n else None
    return EagleHead(target.config, ids)


def load_head(path: str | Path, target, expect_type: str | None = None) -> tuple[nn.Module, dict]:
    """Load the head in ``path`` for ``target`` (checked to be the model it was trained on)."""
    from safetensors.torch import load_file

    meta = read_head_config(path, expect_type)
    check_signature(meta.get("target_signature", {}), target, str(path))
    head = build_head(meta, target)
    state = load_file(str(Path(path) / "head.safetensors"))
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        raise ConfigError(f"head weights in {path} do not match its config.json: {str(e).splitlines()[0]}") from e
    head = head.to(target.dtype).eval()
    for p in head.parameters():
        p.requires_grad_(False)
    return head, meta
