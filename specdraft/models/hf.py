"""The transformers backend: any causal LM behind the model interface (models/base.py).

- ``HFModel``: the model's facts and capabilities (its final-norm features, token trees).
- ``HFRows`` (``HFModel.new_rows()``): the batched KV state, for the decode loop and for draft models
  alike. One transformers
  ``DynamicCache`` of shape [B, H, L, D] shared by all rows, through the stock model classes: every
  cache slot has a per-row validity bit, turned into a 4D additive attention mask, and every fed
  token gets an explicit per-row position id (its row's own length), so a row never sees another
  row's padding or its own rejected drafts. Each forward appends N = max(tokens fed) slots to every
  row; after verification a row keeps its pending token + accepted drafts (or tree path), the rest
  become holes (masked). Columns no row uses are trimmed; when the holes grow past
  ``compact_slack`` slots the cache is compacted (each row's valid slots gathered to the right,
  left-padded). A joining row is prefilled on its own and left-padded into the batch. The validity
  bits and the ids, positions and mask built from them live on the host; each forward sends them to
  the model's device, where the cache, the logits and the features stay.

This file is the only place that touches transformers' model and cache internals. A model whose
cache is not one plain full-attention layer per decoder layer (sliding-window or hybrid caches, where
``get_seq_length`` does not follow direct writes to ``layer.keys``) is refused at load.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from ..core.device import HOST
from .base import Capabilities, ModelFacts, SavedPrefix


def check_cache_layout(model) -> None:
    """Refuse a model whose cache is not one plain full-attention layer per decoder layer: the rows'
    holes, trims and tree-path gathers write ``layer.keys`` directly, which sliding-window and hybrid
    cache layers do not follow (they would decode at wrong positions after a tree step)."""
    kinds = {type(layer).__name__ for layer in DynamicCache(config=model.config).layers}
    if kinds - {"DynamicLayer"}:
        from ..core.errors import ConfigError

        raise ConfigError(
            f"{type(model).__name__} uses cache layers {sorted(kinds)} (sliding-window or hybrid "
            "attention); specdraft supports full-attention caches only (DynamicLayer)"
        )


class HFModel:
    backend = "hf"
    source: dict | None = None  # set by load_model (models/backends.py); None: made in memory
    prefill_twin = None  # set by api._self_draft (models/base.py TargetModel)

    def __init__(self, model, tokenizer=None, name: str = "model"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.quantization: dict | None = None  # set when the linear layers are int8 / int4 (models/lowbit.py)
        self.config = model.config
        self.device = next(model.parameters()).device
        # transformers 5.x renamed past_key_values to cache; accept models of either style
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.capture_hidden = False  # the feature hooks' switch: on during a forward(hidden=True) only
        self.last_hidden_batch: dict | None = None  # during a forward(hidden=True): what each hook saw
        self.feature_layers: tuple[int, ...] = ()  # decoder layers handed over beside the final norm
        self._hooks: dict = {}  # "norm" or a layer's hidden-states index -> its forward hook
        check_cache_layout(model)

    # --- facts -------------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            hidden=self._final_norm() is not None,
            trees=True,
            layers=self._layers() is not None,
            head_io=True,
            prefixes=True,
        )

    @property
    def facts(self) -> ModelFacts:
        c = self.config
        heads = int(c.num_attention_heads)
        rope = getattr(c, "rope_parameters", None) or {}
        return ModelFacts(
            model_type=str(getattr(c, "model_type", "")),
            hidden_size=int(c.hidden_size),
            num_layers=int(c.num_hidden_layers),
            vocab_size=self.vocab_size,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
            intermediate_size=int(getattr(c, "intermediate_size", 0) or 4 * c.hidden_size),
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
            max_position_embeddings=self.max_context,
        )

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids.to(self.device))

    def output_rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        w = self.model.get_output_embeddings().weight.detach()
        return w if ids is None else w.index_select(0, ids.to(w.device))

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head (may exceed the tokenizer's size: Qwen pads its vocabulary)."""
        head = self.model.get_output_embeddings()
        return int(getattr(head, "out_features", None) or head.weight.shape[0])

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

    def _final_norm(self) -> torch.nn.Module | None:
        norm = getattr(getattr(self.model, "model", None), "norm", None)
        return norm if isinstance(norm, torch.nn.Module) else None

    def _layers(self) -> torch.nn.ModuleList | None:
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        return layers if isinstance(layers, torch.nn.ModuleList) else None

    def add_feature_layers(self, layers) -> list[int]:
        """Hand over these decoder layers' outputs too (hidden-states indices as ``output_hidden_states``
        counts them: i = the output of decoder layer i - 1, 1 <= i <= num_layers) in every
        forward(hidden=True) from now on; -> the block of ``last_hidden`` each one fills (block 0 is
        the final norm's, block b the columns [b * H, (b + 1) * H)). Layers already handed over keep
        their blocks, so drafters that registered earlier read the same columns."""
        n = self.num_layers
        bad = [i for i in layers if not 1 <= int(i) <= n]
        if bad or self._layers() is None:
            from ..core.errors import ConfigError

            raise ConfigError(
                f"{self.name} has no decoder layer output {bad or list(layers)} to hand over "
                f"(hidden-states indices 1..{n} of model.model.layers)"
            )
        self.feature_layers += tuple(int(i) for i in dict.fromkeys(layers) if int(i) not in self.feature_layers)
        return [1 + self.feature_layers.index(int(i)) for i in layers]

    def _hook_features(self) -> None:
        """Forward hooks on the final norm and on each handed-over layer (each installed once): while
        ``capture_hidden`` is on they keep those modules' outputs; nothing else is materialized and the
        model code is not forked."""
        norm = self._final_norm()
        if norm is None:
            from ..core.errors import ConfigError

            raise ConfigError(f"{type(self.model).__name__} has no model.norm; Medusa/EAGLE heads need the final norm")

        def hook(module, inputs, output, owner=self, key="norm"):
            if owner.capture_hidden:
                out = output[0] if isinstance(output, tuple) else output  # decoder layers of older versions
                owner.last_hidden_batch[key] = out if out.dim() == 3 else out[None]

        todo = [("norm", norm)] + [(i, self._layers()[i - 1]) for i in self.feature_layers]
        for key, module in todo:
            if key not in self._hooks:
                self._hooks[key] = module.register_forward_hook(lambda m, i, o, k=key: hook(m, i, o, key=k))

    def _take_features(self) -> torch.Tensor:
        """What the hooks saw in this forward: [B, n, H * (1 + len(feature_layers))], the final norm's
        output first."""
        seen, self.last_hidden_batch = self.last_hidden_batch, None
        parts = [seen["norm"]] + [seen[i] for i in self.feature_layers]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def new_rows(self, compact_slack: int = 32) -> "HFRows":
        return HFRows(self, compact_slack)


# --- the batched rows (the decode loop's KV state) -------------------------------------------


def _kv(layer):
    k = getattr(layer, "keys", None)
    if not getattr(layer, "is_initialized", k is not None) or k is None or k.dim() != 4:
        return None
    return layer.keys, layer.values


def _set(layer, k, v):
    layer.keys, layer.values = k, v
    if not getattr(layer, "is_initialized", True):
        layer.device = k.device
        layer.is_initialized = True


def _left_pad(t, rows: int, have: int, new_len: int, ref: torch.Tensor) -> torch.Tensor:
    """KV ``t`` [rows, H, have, D] left-padded with zeros to ``new_len`` positions; None: zeros (H, D: ``ref``'s)."""
    H, D = ref.shape[1], ref.shape[3]
    if t is None:
        return ref.new_zeros(rows, H, new_len, D)
    if new_len > have:
        return torch.cat([t.new_zeros(rows, H, new_len - have, D), t], dim=2)
    return t


class HFRows:
    """A KV cache of B rows with per-row lengths (``lens``) and holes, over one HFModel's weights."""

    def __init__(self, model: "HFModel", compact_slack: int = 32):
        self.model = model
        self.compact_slack = compact_slack
        self.cache = DynamicCache(config=model.config)
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=HOST)  # [B, L]: bookkeeping, on the host
        self.lens: list[int] = []
        self._last_n = 0
        self.last_hidden: torch.Tensor | None = None  # [B, N, H] of the last forward(hidden=True)
        self.prefill_hidden: list = []  # per row of the last add_rows(hidden=True): [len(prefix), H] or None

    @property
    def B(self) -> int:
        return len(self.lens)

    @property
    def L(self) -> int:
        return int(self.valid.shape[1])

    def _layers(self):
        return self.cache.layers

    def _map(self, fn):
        """Apply fn(tensor [B, H, L, D]) -> tensor to every layer's keys and values."""
        for layer in self._layers():
            kv = _kv(layer)
            if kv is not None:
                _set(layer, fn(kv[0]), fn(kv[1]))

    def add_row(self, prefix: list[int]) -> int:
        """Prefill ``prefix`` (may be empty) as a new last row; returns its index."""
        return self.add_rows([prefix])[0]

    @torch.inference_mode()
    def add_rows(
        self, prefixes: list[list[int]], hidden: bool = False, start: list[tuple[SavedPrefix, int] | None] | None = None
    ) -> list[int]:
        """Prefill several prefixes (ragged, may be empty) together in one forward of their own,
        then append them as new last rows (left-padded to the batch); returns their indices.
        ``hidden``: also leave each prefix's final-norm features in ``prefill_hidden`` (a row
        [len(prefix), H], None for an empty prefix). ``start``: as ``SequenceRows.add_rows``."""
        new = HFRows(self.model, self.compact_slack)
        m = [0 if s is None else s[1] for s in (start or [None] * len(prefixes))]
        new._load(start or [None] * len(prefixes), m)
        rest = [list(p[k:]) for p, k in zip(prefixes, m)]
        self.prefill_hidden = [None] * len(prefixes)
        if any(rest):
            new.forward(rest, keep=1, hidden=hidden)
            if hidden:
                self.prefill_hidden = [new.last_hidden[i, : len(p)].clone() if p else None for i, p in enumerate(rest)]
                new.last_hidden = None
            new.commit([len(p) for p in rest])
        first = self.B
        self._append(new)
        return list(range(first, self.B))

    def _load(self, start: list, m: list[int]) -> None:
        """Rows, one per m[i], holding start[i]'s first m[i] tokens (right-aligned, as the batch's left padding
        puts them; m[i] 0: empty)."""
        self.lens = list(m)
        M = max(m, default=0)
        self.valid = torch.zeros(len(m), M, dtype=torch.bool, device=HOST)
        for i, k in enumerate(m):
            self.valid[i, M - k :] = True
        if M == 0:
            return
        dev = self.model.device
        layers = [s[0].data if s is not None else None for s in start]
        ref = next(x for x in layers if x is not None)
        for li, pair in enumerate(ref):
            if pair is None:  # a layer this model skips (a layer view): its cache stays empty
                continue
            H, D = pair[0].shape[0], pair[0].shape[2]
            k = pair[0].new_zeros(len(m), H, M, D, device=dev)
            v = k.clone()
            for i, (saved, n) in enumerate(zip(layers, m)):
                if saved is not None and n:
                    k[i, :, M - n :], v[i, :, M - n :] = saved[li][0][:, :n], saved[li][1][:, :n]
            self.cache.update(k, v, li)

    @torch.inference_mode()
    def save_prefix(self, r: int) -> SavedPrefix:
        """Row r's committed tokens' keys and values, copied: per layer ([kv heads, n, head dim] x 2; None for a
        layer whose cache is empty: one a layer view skips)."""
        sel = self.valid[r].nonzero().flatten()[: self.lens[r]]
        layers: list = []
        for layer in self._layers():
            kv = _kv(layer)
            layers.append(None if kv is None else tuple(x[r][:, sel.to(x.device)].clone() for x in kv))
        n = self.lens[r] if any(kv is not None for kv in layers) else 0
        nbytes = sum(x.numel() * x.element_size() for kv in layers if kv is not None for x in kv)
        return SavedPrefix("hf", n, nbytes, layers)

    @torch.inference_mode()
    def adopt_rows(self, src: "HFRows", idx: list[int]) -> list[int]:
        """Append copies of ``src``'s rows ``idx`` (their cached keys and values, holes included), for
        a model whose forward computes the same keys and values as src's on these tokens (checked by
        the caller: ``prefill_twin``); returns their indices here."""
        kvs = [_kv(layer) for layer in src._layers()]
        if not kvs or any(kv is None for kv in kvs):  # nothing cached yet (one-token prompts)
            return self.add_rows([[] for _ in idx])
        new = HFRows(self.model, self.compact_slack)
        sel = torch.tensor(idx, dtype=torch.long, device=HOST)
        dev, on = self.model.device, sel.to(kvs[0][0].device)
        for i, (k, v) in enumerate(kvs):  # (to this model's device: a draft may run on another than src's)
            new.cache.update(k.index_select(0, on).to(dev), v.index_select(0, on).to(dev), i)
        new.valid = src.valid[sel].clone()
        new.lens = [src.lens[i] for i in idx]
        new.trim()
        first = self.B
        self._append(new)
        return list(range(first, self.B))

    @torch.inference_mode()
    def row_kv(self, r: int) -> list:
        """Row r's cached keys and values per layer, as float16 arrays [tokens, kv_heads * head_dim] in
        position order (for another backend's copy of this model: llama.py ``adopt_rows``)."""
        sel = self.valid[r].nonzero().flatten()
        out = []
        for layer in self._layers():
            kv = _kv(layer)
            if kv is None:
                return []
            out.append(
                tuple(
                    x[r][:, sel.to(x.device)]
                    .transpose(0, 1)
                    .reshape(len(sel), -1)
                    .to(device=HOST, dtype=torch.float16)
                    .numpy()
                    for x in kv
                )
            )
        return out

    def _append(self, other: "HFRows") -> None:
        """Concatenate another HFRows' rows below ours, left-padding the shorter one."""
        L, P, B2 = self.L, other.L, other.B
        newL = max(L, P)
        for layer, olayer in zip(self._layers(), other._layers()):
            a, r = _kv(layer), _kv(olayer)
            if a is None and r is None:
                continue
            ref = (a or r)[0]
            k = torch.cat([_left_pad(a and a[0], self.B, L, newL, ref), _left_pad(r and r[0], B2, P, newL, ref)], 0)
            v = torch.cat([_left_pad(a and a[1], self.B, L, newL, ref), _left_pad(r and r[1], B2, P, newL, ref)], 0)
            _set(layer, k, v)
        valid = torch.zeros(self.B + B2, newL, dtype=torch.bool, device=HOST)
        valid[: self.B, newL - L :] = self.valid
        valid[self.B :, newL - P :] = other.valid
        self.valid = valid
        self.lens = self.lens + other.lens

    @torch.inference_mode()
    def remove_rows(self, idx: list[int]) -> None:
        if not idx:
            return
        drop = set(idx)
        keep = [i for i in range(self.B) if i not in drop]
        if not keep:
            self.cache = DynamicCache(config=self.model.config)
            self.valid = torch.zeros(0, 0, dtype=torch.bool, device=HOST)
            self.lens = []
            return
        sel = torch.tensor(keep, dtype=torch.long, device=HOST)
        self._map(lambda t: t.index_select(0, sel.to(t.device)))
        self.valid = self.valid[sel]
        self.lens = [self.lens[i] for i in keep]
        self.trim()

    @torch.inference_mode()
    def forward(
        self, seqs: list[list[int]], keep: int | None = None, trees: list | None = None, hidden: bool = False
    ) -> torch.Tensor:
        """Feed row r the tokens ``seqs[r]`` (ragged; may be empty) at positions lens[r].. in one
        forward; returns float32 logits [B, N, V], N = max len (row r's first len(seqs[r]) are real);
        ``keep`` returns only the last ``keep`` positions' logits (prefill).

        ``trees[r]`` (optional; None = a causal chain) is ``(allow [n, n] bool, offsets [n] long)`` for
        row r's n fed tokens: fed token i attends to the row's valid cache slots and to the fed tokens
        j with allow[i, j] (itself and its ancestors, for a token tree), at position lens[r] + offsets[i].
        The slots stay provisional until ``commit``. ``hidden``: also leave the final norm's output of
        every fed position in ``last_hidden`` [B, N, H] (row r's first len(seqs[r]) are real; the
        model's final-norm hook, switched on for this forward only)."""
        N = max(max(len(s) for s in seqs), 1)
        ids = torch.zeros(self.B, N, dtype=torch.long, device=HOST)
        for r, s in enumerate(seqs):
            if s:
                ids[r, : len(s)] = torch.as_tensor(s, dtype=torch.long, device=HOST)
        mask, pos = self._mask_and_positions(seqs, N, trees)
        dev = self.model.device
        kw = {self.model._cache_kw: self.cache}
        m = self.model
        self.last_hidden = None
        if hidden:
            m._hook_features()
            m.capture_hidden, m.last_hidden_batch = True, {}
        try:
            out = m.model(
                input_ids=ids.to(dev),
                attention_mask=None if mask is None else mask.to(dev),
                position_ids=pos.to(dev),
                use_cache=True,
                logits_to_keep=keep or N,
                **kw,
            )
        finally:
            if hidden:
                m.capture_hidden = False
        if hidden:
            self.last_hidden = m._take_features()
        self._last_n = N
        self.valid = torch.cat([self.valid, torch.zeros(self.B, N, dtype=torch.bool, device=HOST)], dim=1)
        return out.logits.float()

    def _mask_and_positions(self, seqs, N: int, trees) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The 4D additive mask [B, 1, N, L + N] (None when plain causal attention is exact: every cache
        slot valid, every row feeding a chain of N tokens; a single request's usual step) and the
        position ids [B, N]."""
        B, L = self.B, self.L
        pos = torch.tensor(self.lens, dtype=torch.long, device=HOST)[:, None] + torch.arange(N, device=HOST)[None, :]
        has_tree = trees is not None and any(t is not None for t in trees)
        if not has_tree and all(len(s) == N for s in seqs) and bool(self.valid.all()):
            return None, pos
        local = torch.tril(torch.ones(N, N, dtype=torch.bool, device=HOST))[None].expand(B, N, N)
        if has_tree:
            local = local.clone()
            for r, t in enumerate(trees):
                if t is not None:
                    allow, off = t
                    m = allow.shape[0]
                    local[r, :m, :m] = allow
                    pos[r, :m] = self.lens[r] + off
        allow = torch.cat([self.valid[:, None, :].expand(B, N, L), local], dim=2)
        dt = self.model.dtype
        return torch.zeros(B, 1, N, L + N, dtype=dt, device=HOST).masked_fill(~allow[:, None], torch.finfo(dt).min), pos

    @torch.inference_mode()
    def commit(self, keep: list) -> None:
        """Of the last forward's slots, row r keeps its first keep[r] (an int), or the slots listed in
        keep[r] (ascending indices into the row's fed tokens: a tree's pending token + accepted
        path); the rest become holes."""
        N, L = self._last_n, self.L
        if all(isinstance(x, int) for x in keep):
            k = torch.tensor(keep, dtype=torch.long, device=HOST)
            self.valid[:, L - N :] = torch.arange(N, device=HOST)[None, :] < k[:, None]
            self.lens = [a + int(b) for a, b in zip(self.lens, keep)]
        else:
            new = torch.zeros(self.B, N, dtype=torch.bool, device=HOST)
            for r, x in enumerate(keep):
                if isinstance(x, int):
                    new[r, :x] = True
                elif len(x):
                    new[r, torch.as_tensor(x, dtype=torch.long, device=HOST)] = True
            self.valid[:, L - N :] = new
            self.lens = [a + (x if isinstance(x, int) else len(x)) for a, x in zip(self.lens, keep)]
        self.trim()
        if self.L - max(self.lens, default=0) >= self.compact_slack:
            self.compact()

    @torch.inference_mode()
    def truncate(self, r: int, n: int) -> None:
        """Keep only row r's first n cached tokens (rollback of one row; call trim() after)."""
        if n < self.lens[r]:
            slots = self.valid[r].nonzero().flatten()
            self.valid[r, slots[n:]] = False
            self.lens[r] = n

    def draft_room(self) -> None:
        """Each row's cache grows as needed: no shared bound on a forward's feed."""
        return None

    @torch.inference_mode()
    def trim(self) -> None:
        """Drop leading and trailing columns that no row uses."""
        used = self.valid.any(dim=0).nonzero().flatten()
        if used.numel() == 0:
            lo, hi = 0, 0
        else:
            lo, hi = int(used[0]), int(used[-1]) + 1
        if lo == 0 and hi == self.L:
            return
        self._map(lambda t: t[:, :, lo:hi])
        self.valid = self.valid[:, lo:hi]

    @torch.inference_mode()
    def compact(self) -> None:
        """Gather each row's valid slots to the right end (left padding); removes every hole."""
        B, L2 = self.B, max(self.lens, default=0)
        idx = torch.zeros(B, L2, dtype=torch.long, device=HOST)
        valid = torch.zeros(B, L2, dtype=torch.bool, device=HOST)
        for r in range(B):
            slots = self.valid[r].nonzero().flatten()
            idx[r, L2 - slots.numel() :] = slots
            valid[r, L2 - slots.numel() :] = True

        def gather(t):
            i = idx.to(t.device)[:, None, :, None].expand(B, t.shape[1], L2, t.shape[3])
            return t.gather(2, i)

        self._map(gather)
        self.valid = valid

    def holes(self) -> int:
        return int(self.B * self.L - int(self.valid.sum()))
