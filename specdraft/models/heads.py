"""Trained draft heads on the target's own features: Medusa and EAGLE.

Both read the target's *feature*: the last hidden state after the final norm, i.e. the input of
the LM head (``HFModel`` captures it with a forward hook on the final norm when a drafter asks).
Both reuse the target's frozen embedding and LM head; only the head's own weights are trained
(``specdraft train``, specdraft/commands/train.py) and saved.

- ``MedusaHeads`` (Medusa-1): K heads, head i = ``n_blocks`` residual blocks h + SiLU(W h) on the
  feature f_t, then the target's LM head; head i predicts the token at offset i + 2 from the
  position whose feature it reads (the LM head itself predicts offset 1).
- ``EagleHead`` (EAGLE-1): ``fc(concat(f_t, embed(x_{t+1})))`` -> one decoder layer of the target's
  own transformers class (built from its config with num_hidden_layers=1; no forked modeling code)
  -> the predicted feature f_{t+1}; the target's LM head on it predicts x_{t+2}. Autoregressive on
  features with its own KV cache. Optionally a reduced draft vocabulary (``draft_ids``: the most
  frequent training tokens); the draft's distribution is then 0 outside those ids.
- ``Eagle3Head`` (EAGLE-3): the same one decoder layer, fed the fusion of three target layers'
  outputs (low, middle, high) instead of the final-norm feature, its own final norm and a trained LM
  head over a reduced draft vocabulary (below).

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

from ..core.errors import ConfigError

HEAD_TYPES = ("medusa", "eagle", "eagle3")


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
                              f"(target {_trained_for(where)!r}); this target has {key}={now[key]!r}")
    a, b = saved.get("lm_head_fingerprint"), now["lm_head_fingerprint"]
    if a is None or abs(a - b) > 1e-2 * max(abs(a), abs(b), 1e-6):
        raise ConfigError(f"head {where} was trained for target {_trained_for(where)!r}, whose LM head weights "
                          f"differ from this target's (fingerprint {a} vs {b}): a head only fits the model it was "
                          "trained on")


def _trained_for(where: str) -> str | None:
    """The target the head directory's config records (the signature holds its facts, not its name)."""
    try:
        return read_head_config(where).get("target")
    except ConfigError:
        return None


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


# --- EAGLE-3 ---------------------------------------------------------------------------------
def eagle3_layers(n_layers: int) -> tuple[int, int, int]:
    """The target layers an EAGLE-3 head reads, as hidden-states indices (i = decoder layer i - 1's
    output): 2, N // 2 and N - 3, the low / middle / high layers of the EAGLE-3 reference code
    (SpecForge captures the outputs of layers 1, N/2 - 1 and N - 4, the same three). Low layers still
    carry the token's identity, the middle ones what is being said, the high ones the next token; the
    last three layers are skipped because they mostly sharpen the final distribution, which the head
    predicts itself. Qwen2.5 1.5B (28 layers): 2, 14, 25; SmolLM2 (30): 2, 15, 27."""
    if n_layers < 4:
        return (1, max(1, n_layers // 2), n_layers)  # tiny test models: first, middle, last
    return (2, n_layers // 2, n_layers - 3)


EAGLE3_INTERMEDIATE = 2048  # the head's MLP width (Qwen 1.5B's own is 8960): see Eagle3Head's sizes
EAGLE3_DRAFT_VOCAB = 12288


class Eagle3Head(EagleHead):
    """EAGLE-3 (Li et al. 2025): ``fuse`` (3H -> H) turns the target's three layer outputs at
    position t into g_t; the pair (g_t, embed(x_{t+1})), each RMS-normalized, is projected from 2H to
    H (EagleHead's ``fc``) and goes through one decoder layer of the target's own class (stock
    transformers code; its attention takes H, which is why the pair is projected first, where the
    reference layer widens q/k/v to 2H) and predicts the next feature, whose ``norm`` + ``lm_head``
    (draft vocabulary ``draft_ids``, rows initialized from the target's LM head) give the draft logits.
    Step 1 of a draft reads the fused target features; later steps feed the head's own output back in
    place of g (EAGLE-3's test time, trained that way: train.py's training-time test). The input's
    width tells which: 3H is the target's, H the head's own.

    Sizes for Qwen2.5-Coder-1.5B (H 1536): fuse 7.08M, fc 4.72M, the layer's attention 5.51M, its MLP
    at ``intermediate_size`` 2048 (not the target's 8960) 9.44M, the LM head over 12,288 draft tokens
    18.87M: 45.6M parameters, stored as int8 with a scale per row (``save_head(..., int8=True)``) 45.7 MB;
    per draft token it reads about 39M weights, 2.5% of a target forward's 1.54G."""

    def __init__(self, target_config, layers, draft_ids: torch.Tensor, intermediate_size: int | None = None):
        cfg = copy.deepcopy(target_config)
        if intermediate_size:
            cfg.intermediate_size = int(intermediate_size)
        super().__init__(cfg, draft_ids)
        h = self.hidden
        self.layers = tuple(int(i) for i in layers)
        self.fuse = nn.Linear(len(self.layers) * h, h, bias=False)
        ln = self.body.layers[0].input_layernorm  # the target's RMSNorm class, fresh weights
        self.norm_e, self.norm_g, self.norm = copy.deepcopy(ln), copy.deepcopy(ln), copy.deepcopy(ln)
        self.lm_head = nn.Linear(h, int(draft_ids.numel()), bias=False)

    def forward(self, feats, tok_emb, cache=None, position_ids=None, attention_mask=None):
        """feats [B, T, 3H] (the target's layers) or [B, T, H] (the head's own output), tok_emb
        [B, T, H] -> the next features [B, T, H] (pre-norm: what the next step feeds back)."""
        g = self.fuse(feats) if feats.shape[-1] != self.hidden else feats
        return super().forward(self.norm_g(g), self.norm_e(tok_emb), cache, position_ids, attention_mask)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """[..., draft vocab] logits of predicted features."""
        return self.lm_head(self.norm(out))

    def meta(self) -> dict:
        return {"type": "eagle3", "hidden_size": self.hidden, "layers": list(self.layers),
                "draft_vocab": int(self.draft_ids.numel()), "intermediate_size": int(self.cfg.intermediate_size)}


def int8_state(state: dict) -> dict:
    """Large weight matrices as int8 with a float32 scale per row (symmetric); the rest unchanged. A
    head's storage only: the training state keeps float32 weights."""
    out = {}
    for k, v in state.items():
        if v.is_floating_point() and v.dim() == 2 and v.numel() >= 1 << 16:
            scale = v.float().abs().amax(1).clamp(min=1e-12) / 127
            out[k] = torch.round(v.float() / scale[:, None]).to(torch.int8)
            out[k + INT8_SCALE] = scale
        else:
            out[k] = v
    return out


INT8_SCALE = ".int8_scale"


def dequantized(state: dict) -> dict:
    scales = {k[: -len(INT8_SCALE)]: v for k, v in state.items() if k.endswith(INT8_SCALE)}
    return {k: (v.float() * scales[k][:, None] if k in scales else v)
            for k, v in state.items() if not k.endswith(INT8_SCALE)}


# --- saving and loading ----------------------------------------------------------------------
def save_head(head: nn.Module, out: Path, extra: dict, int8: bool = False) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous().clone() for k, v in head.state_dict().items()}
    if int8:
        state = int8_state(state)
        extra = {**extra, "storage": "int8"}
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
        raise ConfigError(f"head directory {str(p)!r} not found (train one with `specdraft train medusa|eagle|eagle3 "
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
    if meta["type"] == "eagle3":
        ids = torch.zeros(int(meta["draft_vocab"]), dtype=torch.long)
        return Eagle3Head(target.config, meta["layers"], ids, meta.get("intermediate_size"))
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
    if meta.get("storage") == "int8":
        state = dequantized(state)
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        raise ConfigError(f"head weights in {path} do not match its config.json: {str(e).splitlines()[0]}") from e
    head = head.to(target.dtype).eval()
    for p in head.parameters():
        p.requires_grad_(False)
    return head, meta
