"""A small adapter over any transformers causal LM: the only place that touches model internals.

The adapter owns one KV cache (a transformers ``DynamicCache``) for a single sequence and tracks
how many positions it holds. The engine talks to it through three calls:

- ``forward(ids, keep)``: append ``ids`` to the cache and return the logits of the last ``keep``
  positions (prefill is just a forward of the whole prompt);
- ``crop(n)``: keep only the first ``n`` cached positions (rollback after a rejection);
- ``reset()``: start a new sequence.

Trees (next issue) add a 4D attention mask and explicit position ids to ``forward`` and a gather
along the sequence axis to the cache; nothing else changes.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache


class HFModel:
    def __init__(self, model, tokenizer=None, name: str = "model"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        self.cache: DynamicCache | None = None
        self.cached_len = 0
        self.device = next(model.parameters()).device
        # transformers 5.x renamed past_key_values to cache; accept models of either style
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.capture_hidden = False  # set by drafters that read the target's features (Medusa, EAGLE)
        self.last_hidden: torch.Tensor | None = None
        self.last_hidden_batch: torch.Tensor | None = None  # [B, n, H]: the batch engine's rows
        self._hidden_hook = None

    # --- facts -------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head (may exceed the tokenizer's size: Qwen pads its vocabulary)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.config):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if e is None:
                continue
            ids.update([e] if isinstance(e, int) else list(e))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def enable_hidden_capture(self) -> None:
        """From now on each ``forward`` also leaves ``last_hidden`` [n, H]: the final norm's output
        (the LM head's input) for every position fed, not only the kept ones (row 0 of a batched
        forward; ``last_hidden_batch`` [B, n, H] keeps every row). One forward hook on the final
        norm; no other layer's hidden states are materialized."""
        self.capture_hidden = True
        if self._hidden_hook is not None:
            return
        norm = getattr(getattr(self.model, "model", None), "norm", None)
        if not isinstance(norm, torch.nn.Module):
            from ..errors import ConfigError

            raise ConfigError(f"{type(self.model).__name__} has no model.norm; Medusa/EAGLE heads need the final norm")

        def hook(module, inputs, output, owner=self):
            if owner.capture_hidden:
                owner.last_hidden = output[0] if output.dim() == 3 else output
                owner.last_hidden_batch = output if output.dim() == 3 else output[None]

        self._hidden_hook = norm.register_forward_hook(hook)

    # --- cache -------------------------------------------------------------------------------
    def reset(self) -> None:
        self.cache = DynamicCache(config=self.config)
        self.cached_len = 0

    def crop(self, n: int) -> None:
        """Keep the first n cached positions."""
        if n < self.cached_len:
            self.cache.crop(n - self.cached_len)  # transformers 5.x: a negative count drops positions
            self.cached_len = n

    # --- compute -----------------------------------------------------------------------------
    def keep_positions(self, idx: torch.Tensor) -> None:
        """Keep only the cached positions ``idx`` (ascending), e.g. the prefix plus the accepted
        path of a token tree: a gather along the sequence axis of every layer's keys and values."""
        idx = idx.to(self.device)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, idx)
                layer.values = layer.values.index_select(-2, idx)
        self.cached_len = int(idx.shape[0])

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        keep: int = 1,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append ``ids`` (LongTensor [n]) to the cache; return float32 logits [keep, V].

        For a token tree pass the 4D additive ``attention_mask`` and ``position_ids`` from
        ``DraftTree.attention_mask`` / ``position_ids``; the stock model classes accept them."""
        if self.cache is None:
            self.reset()
        ids = ids.reshape(1, -1).to(self.device)
        kw = {self._cache_kw: self.cache}
        if attention_mask is not None:
            kw["attention_mask"] = attention_mask.to(self.device, self.dtype)
        if position_ids is not None:
            kw["position_ids"] = position_ids.to(self.device)
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=keep, **kw)
        self.cached_len += ids.shape[1]
        return out.logits[0].float()
