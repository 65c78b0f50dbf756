"""A draft model whose tokenizer differs from the target's (SmolLM2-135M drafting for Qwen2.5 1.5B):
``method="draft_model"`` with such a draft builds this drafter instead of the same-vocabulary one.

The two models meet in text. Before each draft, the target's tokens are decoded and re-tokenized by
the draft's tokenizer; the draft's cache keeps the longest common prefix with what it held, so a
boundary that tokenizes differently once more text follows (the lookbehind of Universal Assisted
Decoding) is re-fed, not kept wrong.

- Greedy: the draft decodes k of its own tokens; their text is tokenized by the target's tokenizer
  and verified as a chain. Any proposal is exact under greedy verification; the text route only
  decides how much is accepted.
- Sampling: token-level intersection (Timor et al., "Lossless Speculative Decoding Algorithms for
  Heterogeneous Vocabularies"). The draft may only sample its tokens whose bytes are exactly one
  target token; their draft logits are put on those target ids, processed like the target's
  (penalties, grammar), turned into probabilities with the request's sampling parameters (so q is
  renormalized over the intersection) and sampled. That q is what the verifier sees, so standard
  rejection sampling is exact. String-level rejection sampling was not chosen: it needs the
  probability of a string under the draft summed over its tokenizations.

A step drafts nothing (the target decodes one token) when the target's text ends inside a UTF-8
character, or when the draft's context would exceed the draft model's.
"""

from __future__ import annotations

import string

import torch

from ..core.config import SpecConfig
from ..core.device import HOST
from ..core.errors import TokenizerMismatchError
from ..core.sampling import probs_from_logits, sample
from ..core.tree import DraftTree
from .base import Drafter, common_prefix, confident

WINDOW = 8  # draft tokens of context decoded with the draft, to cut the draft's own text out
# text a draft must write back unchanged (with the target's special tokens) to draft for another tokenizer
PROBE = string.printable + " àéîõü ß Ωπ 中文 日本語 한국어 😀 — “quotes” «guillemets» def f(x):\n\treturn x**2\n"


def token_bytes(tok, size: int) -> dict[int, bytes]:
    """Each token id's bytes (byte-level BPE through its byte alphabet; special and added tokens by
    their text; other tokenizers by decoding the single token, skipping partial characters)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    special = {i: t for t, i in (tok.get_added_vocab() if hasattr(tok, "get_added_vocab") else {}).items()}
    byte_level = type(getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)).__name__ == "ByteLevel"
    inv = {c: b for b, c in bytes_to_unicode().items()}
    out = {}
    for i in range(size):
        if i in special:
            out[i] = special[i].encode()
        elif byte_level:
            s = tok.convert_ids_to_tokens(i)
            if s is not None and all(c in inv for c in s):
                out[i] = bytes(inv[c] for c in s)
        else:
            s = tok.decode([i])
            if s and "\ufffd" not in s:
                out[i] = s.encode()
    return out


class VocabBridge:
    """Text both ways between the target's and the draft's tokenizers, and the intersection: draft
    ids whose bytes are exactly one target token (``draft_ids[j]`` is ``target_ids[j]``), on ``device``: the
    draft model's, whose logits they index."""

    def __init__(self, target_tok, draft_tok, target_vocab: int, draft_vocab: int, device: torch.device = HOST):
        self.t, self.d = target_tok, draft_tok
        index = {}
        for i, b in token_bytes(target_tok, min(target_vocab, len(target_tok))).items():
            index.setdefault(b, i)
        pairs = [
            (d, index[b]) for d, b in token_bytes(draft_tok, min(draft_vocab, len(draft_tok))).items() if b in index
        ]
        self.draft_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long, device=device)
        self.target_ids = torch.tensor([t for _, t in pairs], dtype=torch.long, device=device)
        self.to_draft_id = dict(zip(self.target_ids.tolist(), self.draft_ids.tolist()))
        self._check_round_trip()

    def _check_round_trip(self) -> None:
        """The draft must write what the target writes (ordinary text in many scripts, and the target's
        special tokens), or its drafts would continue a context it cannot see: refuse such a pair
        rather than draft blind."""
        specials = list(getattr(self.t, "all_special_tokens", []) or [])
        for text in specials + [self.target_text(self.target_tokens(PROBE))]:  # the probe as the target writes it
            back = self.d.decode(self.draft_tokens(text), skip_special_tokens=False)
            if back != text:
                raise TokenizerMismatchError(
                    f"the draft's tokenizer cannot write the target's text: {text[:40]!r} comes back as "
                    f"{back[:40]!r}. A draft with another tokenizer must encode any text the target produces "
                    "(byte-level BPE tokenizers do); use a draft with a byte-level tokenizer or a model-free method"
                )

    def target_text(self, ids: list[int]) -> str:
        return self.t.decode(ids, skip_special_tokens=False)

    def draft_tokens(self, text: str) -> list[int]:
        return list(self.d(text, add_special_tokens=False)["input_ids"])

    def target_tokens(self, text: str) -> list[int]:
        return list(self.t(text, add_special_tokens=False)["input_ids"])


class CrossVocabDrafter(Drafter):
    name = "cross_vocab"  # method draft_model with a draft of another tokenizer

    def __init__(self, model, bridge: VocabBridge, spec: SpecConfig, target_vocab: int):
        self.model, self.bridge, self.spec, self.target_vocab = model, bridge, spec, target_vocab
        self.draft_eos = model.eos_token_ids()
        self.kv = None

    def max_draft_depth(self) -> int:
        return self.spec.k

    def begin(self, prompt_ids, sp, generator, processor=None) -> None:
        self.sp, self.gen, self.processor = sp, generator, processor
        self.kv = self.model.new_rows()
        self.kv.add_rows([[]])
        self.held: list[int] = []  # the draft tokens in the draft's cache

    def _sync(self, tokens: list[int], k: int) -> list[int] | None:
        """Re-tokenize the target's text for the draft; crop the draft's cache to the common prefix;
        -> the draft tokens to feed (at least one), or None when the draft cannot go on this step."""
        text = self.bridge.target_text(tokens)
        want = self.bridge.draft_tokens(text)
        if not want or text.endswith("\ufffd") or len(want) + k > self.model.max_context:
            return None
        same = min(
            common_prefix(self.held, want), len(want) - 1
        )  # the last token is fed again: its logits start the draft
        self.kv.truncate(0, same)
        self.kv.trim()
        self.held = want[:same]
        return want[same:]

    def propose(self, tokens: list[int], max_tokens: int) -> DraftTree:
        """k = max_tokens draft tokens (the request's schedule chose it), fewer under the confidence rule."""
        feed = self._sync(tokens, max_tokens) if max_tokens > 0 else None
        if feed is None:
            return DraftTree.empty()
        thr = self.spec.params.confidence_threshold
        n_ctx = len(self.held) + len(feed)  # the draft's context; drafted tokens follow it
        drafted, targets, probs = [], [], []
        for step in range(max_tokens):
            logits = self.kv.forward([feed], keep=1)[0, -1]
            self.kv.commit([len(feed)])
            self.held += feed
            if self.sp.greedy:
                if not confident(thr, step, lambda lg=logits: torch.softmax(lg.float(), -1).max()):
                    break
                d = int(logits.argmax())
            else:
                q = self._intersection_q(logits, tokens + targets)
                if q is None or not confident(thr, step, q.max):
                    break
                t = int(sample(q, self.gen))
                probs.append(q)
                targets.append(t)
                d = self.bridge.to_draft_id[t]
            drafted.append(d)
            if d in self.draft_eos:
                break
            feed = [d]
        if not self.sp.greedy:
            return DraftTree.chain(targets, torch.stack(probs)) if targets else DraftTree.empty()
        return self._as_target_chain(drafted, n_ctx, max_tokens)

    def _intersection_q(self, draft_logits: torch.Tensor, history: list[int]) -> torch.Tensor | None:
        """The draft's distribution over the intersection, on the target's vocabulary, processed and
        shaped by the request's sampling parameters (so renormalized over the intersection); None when
        the processing leaves no token of the intersection."""
        b = self.bridge
        lt = draft_logits.new_full((self.target_vocab,), float("-inf"))
        lt[b.target_ids] = draft_logits[b.draft_ids]
        if self.processor is not None:
            lt = self.processor.process(lt[None], history)[0]
        elif len(b.draft_ids):  # unprocessed, the intersection stays finite: no sync to check it
            return probs_from_logits(lt, self.sp)
        return probs_from_logits(lt, self.sp) if torch.isfinite(lt).any() else None

    def _as_target_chain(self, drafted: list[int], n_ctx: int, max_tokens: int) -> DraftTree:
        """The draft's text after its context (its first n_ctx held tokens), as target tokens (a trailing
        partial character dropped)."""
        ctx = self.held[max(0, n_ctx - WINDOW) : n_ctx]
        base = self.bridge.d.decode(ctx, skip_special_tokens=False)
        full = self.bridge.d.decode(ctx + drafted, skip_special_tokens=False)
        if not full.startswith(base):
            return DraftTree.empty()
        piece = full[len(base) :].rstrip("\ufffd")
        ids = self.bridge.target_tokens(piece)[:max_tokens] if piece else []
        return DraftTree.chain(ids) if ids else DraftTree.empty()
