"""The EAGLE-3 head in the reference layout (the EAGLE repository, SpecForge, vLLM and SGLang read and
write the same tensors), built from stock transformers Llama modules.

    fc          [H, 3 * H_target]   the target's three layer outputs at position t -> g_t (no bias)
    midlayer    one Llama decoder layer whose q/k/v read 2H: concat(input_layernorm(embed(x_{t+1})),
                hidden_norm(g_t)); its residual stream starts from g_t (or from hidden_norm(g_t) where
                ``norm_before_residual``); o_proj, post_attention_layernorm and the MLP as in Llama
    norm        the final RMSNorm, then
    lm_head     [draft_vocab, H] over a reduced draft vocabulary
    d2t         int64 [draft_vocab]: OFFSETS, target id = draft index + d2t[draft index]
    t2d         bool [target vocab]: which target ids the draft vocabulary holds

The target's embedding is frozen and shared (``TargetModel.embed``); a checkpoint may carry a copy
(``embed_tokens``), which is not needed here. Step 1 of a draft feeds fc(target features); later
steps feed the layer's own pre-norm output back in place of g (EAGLE-3's training-time test), so
``forward`` takes either a [.., 3 H_target] tensor (fused by fc) or a [.., H] one (used as it is).

Aux layers (``layers``) are hidden-states indices as transformers' ``output_hidden_states`` counts them
(i = the output of decoder layer i - 1, the input of layer i), which is vLLM's convention for
``eagle_aux_hidden_state_layer_ids``; SGLang's checkpoints store i - 1 (the layer whose output is
taken) and add 1 when loading (models/head_formats.py converts).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from .base import ModelFacts


@dataclass(frozen=True)
class Eagle3Shape:
    """What an EAGLE-3 head's tensors are sized by (a checkpoint's config.json says the same)."""

    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    layers: tuple[int, ...]  # aux hidden-states indices (module doc)
    norm_before_residual: bool = False
    fc_bias: bool = False

    @classmethod
    def for_target(cls, facts: ModelFacts, layers, draft_vocab: int, intermediate_size: int | None = None):
        """A new head for a target: its attention shape, the given MLP width (default the target's own)."""
        return cls(
            hidden_size=facts.hidden_size,
            target_hidden_size=facts.hidden_size,
            num_attention_heads=facts.num_attention_heads,
            num_key_value_heads=facts.num_key_value_heads,
            head_dim=facts.head_dim,
            intermediate_size=int(intermediate_size or facts.intermediate_size),
            rms_norm_eps=facts.rms_norm_eps,
            rope_theta=facts.rope_theta,
            max_position_embeddings=facts.max_position_embeddings,
            vocab_size=facts.vocab_size,
            draft_vocab_size=int(draft_vocab),
            layers=tuple(int(i) for i in layers),
        )

    def llama_config(self):
        from transformers import LlamaConfig

        cfg = LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        cfg._attn_implementation = "sdpa"
        return cfg


def eagle3_layers(n_layers: int) -> tuple[int, int, int]:
    """The default aux layers (hidden-states indices): 2, N // 2 and N - 3, the low / middle / high
    layers every reference engine defaults to. Low layers still carry the token's identity, the middle
    ones what is being said, the high ones the next token; the last layers mostly sharpen the final
    distribution, which the head predicts itself. Qwen2.5 1.5B (28 layers): 2, 14, 25."""
    if n_layers < 4:
        return (1, max(1, n_layers // 2), n_layers)  # tiny test models: first, middle, last
    return (2, n_layers // 2, n_layers - 3)


class Eagle3Layer(nn.Module):
    """The reference ``midlayer``: stock Llama attention (q/k/v widened to 2H), MLP and RMSNorms."""

    def __init__(self, shape: Eagle3Shape, cfg):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        H, eps = shape.hidden_size, shape.rms_norm_eps
        self.norm_before_residual = shape.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(H, eps=eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=eps)
        attn = LlamaAttention(cfg, layer_idx=0)
        d = shape.head_dim
        attn.q_proj = nn.Linear(2 * H, shape.num_attention_heads * d, bias=False)
        attn.k_proj = nn.Linear(2 * H, shape.num_key_value_heads * d, bias=False)
        attn.v_proj = nn.Linear(2 * H, shape.num_key_value_heads * d, bias=False)
        self.self_attn = attn
        self.mlp = LlamaMLP(cfg)

    def forward(self, emb, g, position_embeddings, attention_mask, cache):
        h = self.hidden_norm(g)
        residual = h if self.norm_before_residual else g
        x = torch.cat([self.input_layernorm(emb), h], dim=-1)
        attn, _ = self.self_attn(x, position_embeddings=position_embeddings, attention_mask=attention_mask, cache=cache)
        h = residual + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """The head (module doc); ``state_dict()`` keys are the reference checkpoint's names."""

    def __init__(self, shape: Eagle3Shape):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        self.shape = shape
        self.cfg = shape.llama_config()
        H = shape.hidden_size
        self.hidden = H
        self.layers = shape.layers
        self.fc = nn.Linear(len(shape.layers) * shape.target_hidden_size, H, bias=shape.fc_bias)
        self.midlayer = Eagle3Layer(shape, self.cfg)
        self.norm = LlamaRMSNorm(H, eps=shape.rms_norm_eps)
        self.lm_head = nn.Linear(H, shape.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(shape.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(shape.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(self.cfg)

    # --- the draft vocabulary ------------------------------------------------------------------
    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft index (ascending when d2t was made from sorted ids)."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def set_draft_ids(self, ids: torch.Tensor) -> None:
        """d2t and t2d for the draft vocabulary ``ids`` (target ids, sorted ascending)."""
        ids = ids.to(self.d2t.device, torch.long)
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    # --- a forward -----------------------------------------------------------------------------
    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.cfg)

    def forward(self, feats, tok_emb, cache=None, position_ids=None, attention_mask=None):
        """feats [B, T, 3 H_target] (the target's layers) or [B, T, H] (the head's own output), tok_emb
        [B, T, H] (embeddings of the next tokens) -> the next pre-norm features [B, T, H] (what the next
        draft step feeds back). ``attention_mask``: None (causal after the cache) or additive [B, 1, T, S]."""
        g = self.fc(feats) if feats.shape[-1] != self.hidden else feats
        B, T = g.shape[:2]
        past = 0 if cache is None else cache.get_seq_length()
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=g.device)[None].expand(B, T)
        if attention_mask is None and T > 1:
            attention_mask = causal_mask(T, past, g.dtype, g.device)
        pos_emb = self.rotary(g, position_ids)
        return self.midlayer(tok_emb.to(g.dtype), g, pos_emb, attention_mask, cache)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """[..., draft vocab] logits of predicted features."""
        return self.lm_head(self.norm(out))

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


def causal_mask(T: int, past: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive [1, 1, T, past + T]: fed token i sees the cache and fed tokens 0..i."""
    allow = torch.ones(T, past + T, dtype=torch.bool, device=device).tril(past)
    return torch.zeros(allow.shape, dtype=dtype, device=device).masked_fill(~allow, torch.finfo(dtype).min)[None, None]


# --- the training-time test ----------------------------------------------------------------------
# EAGLE-3's (as SpecForge trains): K draft steps per anchor position t. Step 0 reads the target's fused
# features F_t and the embedding of x_{t+1}; step j >= 1 reads the head's own pre-norm output of step
# j - 1 at the same anchor, one position further on (t + j), with the keys of steps 0..j - 1 in the
# head's cache, where anchor t sees step 0's positions <= t (the true context) and its own entries of
# steps 1..j (its draft so far), as a chain drafted from t attends at test time. Step j's target is
# x_{t+j+2} (as a draft-vocabulary index); its cross-entropy is weighted 0.8^j.
TTT_DECAY = 0.8


def ttt_mask(P: int, j: int, dtype: torch.dtype) -> torch.Tensor:
    """Step j's additive mask [1, 1, P, (j + 1) P] over the head's cache of steps 0..j (module doc)."""
    blocks = [torch.tril(torch.ones(P, P, dtype=torch.bool))] + [torch.eye(P, dtype=torch.bool)] * j
    allow = torch.cat(blocks, dim=1)
    return torch.zeros(allow.shape, dtype=dtype).masked_fill(~allow, torch.finfo(dtype).min)[None, None]


def _autocast(device: torch.device, bf16: bool):
    """bf16 autocast where the CPU (or GPU) runs bf16 matrix work natively, float32 elsewhere."""
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def ttt_loss(head, embed, F, toks, labels, device, bf16: bool = False) -> tuple[torch.Tensor, list[float]]:
    """The training-time test over K = labels.shape[-1] draft steps (module doc); ``embed``: the target's
    frozen embedding (ids -> [.., H]). -> (sum_j 0.8^j cross-entropy_j, step accuracies)."""
    B, P, K = labels.shape
    cache = head.new_cache()
    feats = F.to(device)
    labels = labels.to(device)
    total, accs = 0.0, []
    with _autocast(device, bf16):
        for j in range(K):
            with torch.no_grad():
                e = embed(toks[:, j : j + P]).to(device)
            pos = (torch.arange(P, device=device) + j)[None].expand(B, P)
            mask = ttt_mask(P, j, torch.bfloat16 if bf16 else feats.dtype).to(device).expand(B, 1, P, (j + 1) * P)
            out = head(feats, e, cache=cache, position_ids=pos, attention_mask=mask)
            logits = head.draft_logits(out).float()
            y = labels[:, :, j]
            ok = y >= 0
            if ok.any():
                total = total + TTT_DECAY**j * nn.functional.cross_entropy(logits[ok], y[ok])
                accs.append(float((logits[ok].argmax(-1) == y[ok]).float().mean()))
            feats = out
    if not torch.is_tensor(total):
        total = out.sum() * 0
    return total, accs


def ttt_batch(data, idx: list[int], t2d_index: torch.Tensor, K: int, max_len: int):
    """Right-padded batch of P = L - 1 anchors of the sequences ``idx`` of ``data`` (``tokens[i]`` a long
    tensor, ``n_prompt[i]``, ``features(i, n)`` its first n feature rows, ``width`` of a row: offline
    training's data directory, the online learner's replay buffer): features F_t [B, P, 3H]; tokens
    [B, P + K] (x_{t+1} onwards: step j feeds column t + j); labels [B, P, K] (step j at anchor t: x_{t+j+2}
    as a draft vocabulary index, -100 off the answer, past the end or outside the draft vocabulary)."""
    seqs = [(data.tokens[i][:max_len], data.n_prompt[i], i) for i in idx]
    P = max(len(t) for t, _, _ in seqs) - 1
    F = torch.zeros(len(seqs), P, data.width)
    toks = torch.zeros(len(seqs), P + K, dtype=torch.long)
    labels = torch.full((len(seqs), P, K), -100, dtype=torch.long)
    for b, (x, n0, i) in enumerate(seqs):
        T = len(x)
        F[b, : T - 1] = data.features(i, T - 1)
        toks[b, : T - 1] = x[1:]
        t = torch.arange(T - 1)
        for j in range(K):
            at = t + j + 2
            ok = (at < T) & (at >= n0)
            labels[b, t[ok], j] = t2d_index[x[at[ok]]]
    return F, toks, labels
