"""History-dependent logits processing: penalties, logit_bias, min_tokens and structured output.

Each of these changes a position's logits as a function of the tokens before it. Under speculation
the tokens before draft position i are the context *and the draft tokens before i* (along the node's
path in a token tree). So the target's row for node i and the draft's distribution for node i must
both be processed with that history. Processing with the history of the step's start is the classic
bug: it makes speculative output differ from plain decoding.

``RequestProcessor`` does this for one request, on the target side (``process`` over every fed
position, ``prune`` of grammar-invalid draft nodes before the forward) and on the draft side (a
drafter that samples processes its own logits with the same object and the same history). Plain
decoding goes through the same code with an empty draft, so both agree by construction.

Order (as in vLLM's sampler): repetition penalty (prompt + output), then presence and frequency
penalties (output only, OpenAI's semantics), then logit_bias, then min_tokens (EOS masked), then the
grammar mask. Temperature, top-k and top-p come after (``sampling.probs_from_logits``).

Structured output uses llguidance (pinned in requirements.txt): it compiles a JSON schema, a regex
or a Lark grammar into a matcher that gives the allowed-token mask of a state, consumes tokens and
rolls back. The token tree is walked depth first: consume a node's token, take its children's
mask, roll back. docs/design.md says why llguidance and not xgrammar (measured).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch

from .device import HOST
from .errors import ConfigError
from .tree import DraftTree

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # defined by its stub, not exported by the package


class TokenConstraint:
    """A state machine over tokens: which tokens may come next, given the tokens so far.

    ``allowed()`` -> bool [V] at the current state; ``push(t)`` consumes a token (False when it is not
    allowed; the state is then unchanged); ``pop(n)`` undoes the last n pushes."""

    def allowed(self) -> torch.Tensor:
        raise NotImplementedError

    def push(self, token: int) -> bool:
        raise NotImplementedError

    def pop(self, n: int) -> None:
        raise NotImplementedError

    def forced(self) -> list[int]:
        """Tokens the constraint forces from the current state (no other token is allowed), in order."""
        return []


class GrammarConstraint(TokenConstraint):
    """An llguidance matcher: a JSON schema, a regex or a Lark grammar over the model's tokenizer."""

    SHIFTS = torch.arange(32, dtype=torch.int32, device=HOST)

    def __init__(self, matcher, vocab_size: int, eos_ids: set[int]):
        self.m = matcher
        self.V = vocab_size
        self.bits = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32, device=HOST)  # llguidance fills it
        self.eos = torch.tensor(sorted(t for t in eos_ids if t < vocab_size), dtype=torch.long, device=HOST)

    def allowed(self) -> torch.Tensor:
        """On the host (where llguidance writes its bitmask)."""
        import llguidance.torch as lt

        lt.fill_next_token_bitmask(self.m, self.bits, 0)
        a = ((self.bits[0, :, None] >> self.SHIFTS) & 1).bool().reshape(-1)[: self.V]
        if self.m.is_stopped():  # the document is complete (ignore_eos decodes on): EOS only, never nothing
            a = torch.zeros_like(a)
            a[self.eos] = True
        return a

    def push(self, token: int) -> bool:
        if self.m.is_stopped() or self.m.validate_tokens([token]) != 1:
            return False
        return self.m.consume_token(token)

    def pop(self, n: int) -> None:
        if n:
            self.m.rollback(n)

    def forced(self) -> list[int]:
        return [] if self.m.is_stopped() else list(self.m.compute_ff_tokens())


_LL_TOKENIZERS: dict = {}


def _ll_tokenizer(tokenizer, vocab_size: int, eos_ids: set[int]):
    """llguidance's view of a Hugging Face tokenizer, built once per (tokenizer, vocabulary, EOS set):
    building it reads the whole vocabulary (about a second for Qwen's)."""
    import llguidance.hf

    key = (id(tokenizer), vocab_size, tuple(sorted(eos_ids)))
    if key not in _LL_TOKENIZERS:
        _LL_TOKENIZERS[key] = (
            tokenizer,
            llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids)),
        )
    return _LL_TOKENIZERS[key][1]


# JSON is compiled without free whitespace (", " and ": " separators, as json.dumps writes): a model
# that may emit any whitespace can loop on newlines forever, and one canonical form drafts better.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def compile_grammar(sp, tokenizer, vocab_size: int, eos_ids: set[int]) -> GrammarConstraint:
    """The request's json_schema / regex / grammar as a constraint; ConfigError naming the field when it
    does not compile."""
    import llguidance

    if tokenizer is None:
        raise ConfigError("structured output (json_schema, regex, grammar) needs the model's tokenizer")
    if sp.json_schema is not None:
        name = "json_schema"
        try:
            g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(sp.json_schema), defaults=JSON_OPTIONS)
        except ValueError as e:
            raise ConfigError(f"json_schema is not a usable JSON schema: {e}") from None
    elif sp.regex is not None:
        name, g = "regex", llguidance.LLMatcher.grammar_from_regex(sp.regex)
    else:
        name, g = "grammar", llguidance.LLMatcher.grammar_from_lark(sp.grammar)
    try:
        tok = _ll_tokenizer(tokenizer, vocab_size, eos_ids)
    except Exception as e:  # llguidance reads Hugging Face fast tokenizers; anything else cannot be constrained
        raise ConfigError(
            f"structured output needs a Hugging Face fast tokenizer; this model's cannot be read "
            f"({type(e).__name__}: {e})"
        ) from None
    err = llguidance.LLMatcher.validate_grammar(g, tok)
    if err and not err.startswith("WARNING"):  # llguidance's message has caret lines: keep the words
        words = [ln.strip() for ln in err.splitlines() if ln.strip() and set(ln.strip()) != {"^"} and "|" not in ln]
        raise ConfigError(f"{name} does not compile: {' '.join(words)}")
    m = llguidance.LLMatcher(tok, g)
    if m.is_error():
        raise ConfigError(f"{name} does not compile: {m.get_error()}")
    return GrammarConstraint(m, vocab_size, eos_ids)


class RequestProcessor:
    """One request's history-dependent processing (see the module docstring).

    ``committed``: how many tokens of the request's history (prompt + output) the constraint has
    consumed; a call's ``history`` may run past it (a drafter's own draft so far), and those tokens
    are consumed for the call and rolled back after it."""

    def __init__(
        self, sp, prompt_len: int, vocab_size: int, eos_ids: set[int], constraint: TokenConstraint | None = None
    ):
        self.sp = sp
        self.prompt_len = prompt_len
        self.V = vocab_size
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=HOST)
        self.constraint = constraint
        self.committed = prompt_len
        bad = [t for t in sp.logit_bias if t >= vocab_size]
        if bad:
            raise ConfigError(f"logit_bias token id {bad[0]} is outside the vocabulary (size {vocab_size})")
        if sp.logit_bias:
            self.bias_ids = torch.tensor(list(sp.logit_bias), dtype=torch.long, device=HOST)
            self.bias = torch.tensor(list(sp.logit_bias.values()), dtype=torch.float32, device=HOST)

    @staticmethod
    def for_request(
        sp,
        prompt_ids: list[int],
        vocab_size: int,
        eos_ids: set[int],
        tokenizer=None,
        constraint: TokenConstraint | None = None,
    ) -> "RequestProcessor | None":
        """None when the request needs no processing (the hot path stays as it was)."""
        if not sp.processed and constraint is None:
            return None
        if constraint is None and sp.constrained:
            constraint = compile_grammar(sp, tokenizer, vocab_size, eos_ids)
        return RequestProcessor(sp, len(prompt_ids), vocab_size, eos_ids, constraint)

    # --- the positions of one feed: [after the history] + [after each draft node] -----------------------
    def process(self, logits: torch.Tensor, history: list[int], tree=None) -> torch.Tensor:
        """Processed copy of ``logits`` [m, V]: row 0 follows ``history``, row 1 + i follows node i of
        ``tree`` (a DraftTree with m - 1 nodes; None when m == 1). On the logits' device (the target's, or a
        draft model's): what the request brings from the host is sent there."""
        sp = self.sp
        x = logits.float().clone()
        dev = x.device
        parents = [] if tree is None else tree.parents.tolist()
        tokens = [] if tree is None else tree.tokens.tolist()
        if sp.repetition_penalty != 1.0 or sp.presence_penalty or sp.frequency_penalty:
            extra = self._path_counts(parents, tree, dev)
            h = torch.tensor(history, dtype=torch.long, device=dev)
            if sp.repetition_penalty != 1.0:
                seen = (torch.bincount(h, minlength=self.V)[None, : self.V] > 0) | (extra > 0)
                rp = sp.repetition_penalty
                x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
            if sp.presence_penalty or sp.frequency_penalty:
                counts = torch.bincount(h[self.prompt_len :], minlength=self.V)[None, : self.V] + extra
                x = x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0).float()
        if sp.logit_bias:
            x[:, self.bias_ids.to(dev)] += self.bias.to(dev)
        if self.constraint is not None:
            for slot, allowed in self._masks(self.constraint, history, parents, tokens):
                x[slot].masked_fill_(~allowed.to(dev), float("-inf"))
        if sp.min_tokens:
            depth = torch.zeros(len(x), dtype=torch.long, device=HOST)
            if tree is not None and tree.size:
                depth[1:] = tree.depths()
            early = ((len(history) - self.prompt_len + depth) < sp.min_tokens).to(dev)
            eos = _onehot_rows(self.eos, self.V).to(dev)
            # a grammar whose document is complete allows only EOS: it ends the output before min_tokens
            # (masking EOS there would leave no token at all)
            other = (x.masked_fill(eos, float("-inf")) > float("-inf")).any(-1)
            x[(early & other)[:, None] & eos] = float("-inf")
        return x

    def _path_counts(self, parents: list[int], tree, device: torch.device) -> torch.Tensor:
        """[m, V] on ``device``: how often each token occurs on the path to each position (row 0: none)."""
        extra = torch.zeros(len(parents) + 1, self.V, device=device)
        if tree is not None and tree.size:
            node, anc = tree.ancestors().nonzero(as_tuple=True)
            at = ((node + 1).to(device), tree.tokens[anc].to(device))
            extra.index_put_(at, torch.ones(len(node), device=device), accumulate=True)
        return extra

    def _walk(self, c: TokenConstraint, history: list[int], parents: list[int], tokens: list[int], masks: bool):
        """Walk the draft's nodes depth first under the constraint ``c``, starting from the state after
        ``history``. Returns which nodes are valid (a node is valid when its token is allowed after its
        valid parent) and, with ``masks``, the allowed tokens [V] of every position reached as (slot,
        mask) pairs: positions after an invalid node get none (the verifier never reads them)."""
        valid = [False] * len(parents)
        out: list = []
        ahead = history[self.committed :]
        n = 0
        while n < len(ahead) and c.push(ahead[n]):
            n += 1
        if n == len(ahead):  # else a draft that left the grammar (a drafter without the mask): unconstrained
            children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
            for i, p in enumerate(parents):
                children[p + 1].append(i)
            self._visit(c, 0, children, tokens, valid, out if masks else None)
        c.pop(n)
        return valid, out

    def _visit(self, c: TokenConstraint, slot: int, children, tokens, valid, out) -> None:
        if out is not None:
            out.append((slot, c.allowed()))
        for i in children[slot]:
            if c.push(tokens[i]):
                valid[i] = True
                self._visit(c, i + 1, children, tokens, valid, out)
                c.pop(1)

    def _masks(self, c: TokenConstraint, history, parents, tokens):
        return self._walk(c, history, parents, tokens, masks=True)[1]

    # --- the target side's bookkeeping ------------------------------------------------------------
    def prune(self, history: list[int], tree):
        """The draft without the nodes the grammar rules out (and their subtrees): fewer positions for
        the target to score. A chain is cut at its first invalid token."""
        if self.constraint is None or tree.size == 0:
            return tree
        valid, _ = self._walk(self.constraint, history, tree.parents.tolist(), tree.tokens.tolist(), masks=False)
        if all(valid):
            return tree
        return tree.subset(torch.tensor(valid, device=HOST))

    def extend_forced(self, history: list[int], tree, limit: int):
        """A chain with the tokens the grammar forces after it appended (at most ``limit``): the grammar
        drafts them, and the target accepts each one its mask leaves alone (a deterministic proposal,
        one-hot q, so sampling stays exact)."""
        if self.constraint is None or limit <= 0 or not tree.is_chain():
            return tree
        c, seq = self.constraint, history[self.committed :] + tree.tokens.tolist()
        n = 0
        while n < len(seq) and c.push(seq[n]):
            n += 1
        forced = c.forced()[:limit] if n == len(seq) else []
        c.pop(n)
        if not forced:
            return tree
        probs = tree.draft_probs
        if probs is not None:
            forced_q = torch.nn.functional.one_hot(torch.tensor(forced, device=probs.device), probs.shape[-1])
            probs = torch.cat([probs, forced_q.to(probs.dtype)])
        return DraftTree.chain(tree.tokens.tolist() + forced, probs)

    def commit(self, new_tokens: list[int]) -> None:
        """The request's history grew by ``new_tokens`` (emitted after verification)."""
        if self.constraint is not None:
            for t in new_tokens:
                if not self.constraint.push(t):
                    break  # EOS ends the grammar; nothing follows it
        self.committed += len(new_tokens)


def _onehot_rows(ids: torch.Tensor, V: int) -> torch.Tensor:
    m = torch.zeros(1, V, dtype=torch.bool, device=HOST)
    m[0, ids[ids < V]] = True
    return m


def logprob_entries(logits: torch.Tensor, tokens: list[int], top: int) -> list[dict]:
    """OpenAI-style log-probabilities of ``tokens`` [n] under the rows of processed ``logits`` [n, V]
    (before temperature / top-k / top-p): per token its logprob and the ``top`` most likely
    alternatives. A token the processing rules out has logprob -9999.0 (OpenAI's floor: JSON has no -inf)."""
    lp = torch.log_softmax(logits.float(), dim=-1).clamp(min=-9999.0)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None]).squeeze(1).tolist()
    if top:
        vals, ids = torch.topk(lp, top, dim=-1)
        alts = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        alts = [[] for _ in tokens]
    return [{"token_id": t, "logprob": c, "top": a} for t, c, a in zip(tokens, chosen, alts)]
