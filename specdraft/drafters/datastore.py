"""The suffix drafter's global datastore: a tokenized corpus and its suffix array, on disk.

Format (a directory): ``tokens.npy`` (int32; documents separated by -1, ending with -1),
``sa.npy`` (int32 or int64: corpus positions sorted by their suffix's first ``sort_depth`` tokens)
and ``meta.json`` (format, version, counts, the tokenizer's vocabulary size and SHA-256). Loaded
with ``mmap_mode="r"``, so a store costs no RAM until it is searched.

Build: prefix doubling with numpy argsort, stopped at ``sort_depth`` tokens (a pattern or a
continuation never needs more), O(N log N log sort_depth). Lookup: the longest context suffix that
occurs in the corpus by binary search on its length (a suffix of length m occurs only if the one of
length m - 1 does) and, per length, two binary searches over the suffix array, O(log sort_depth x
log N x m); the occurrences are the suffix array range, evenly sampled down to ``limit``.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import deque
from pathlib import Path

import numpy as np

from ..core.errors import DatastoreError
from ..core.jsonl import iter_jsonl

FORMAT = "specdraft-suffix-datastore"
VERSION = 1


def tokenizer_sha256(tokenizer) -> str:
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def concat_docs(docs) -> np.ndarray:
    """Token documents -> one int32 array, each document followed by the separator -1."""
    parts = []
    for d in docs:
        a = np.asarray(d, dtype=np.int64)
        if a.size and (a.min() < 0 or a.max() >= 2**31 - 1):
            raise DatastoreError("token ids must be in [0, 2^31 - 1)")
        parts.append(a.astype(np.int32))
        parts.append(np.array([-1], dtype=np.int32))
    return np.concatenate(parts) if parts else np.array([-1], dtype=np.int32)


def suffix_array(tokens: np.ndarray, sort_depth: int = 64) -> np.ndarray:
    """Positions sorted by their suffix's first ``sort_depth`` tokens (exact for distinguishing
    prefixes up to that length; ties in stable position order). A suffix past the end sorts as
    shorter = smaller, like Python's list comparison."""
    n = tokens.shape[0]
    _, rank = np.unique(tokens, return_inverse=True)
    rank = rank.astype(np.int64).reshape(-1) + 1
    sa = np.argsort(rank, kind="stable")
    h = 1
    while h < sort_depth:
        top = int(rank.max()) + 1
        second = np.zeros(n, dtype=np.int64)
        second[: n - h] = rank[h:]
        key = rank * top + second
        sa = np.argsort(key, kind="stable")
        ks = key[sa]
        new = np.empty(n, dtype=np.int64)
        new[sa] = np.concatenate([[1], 1 + np.cumsum(ks[1:] != ks[:-1])])
        rank = new
        if int(rank.max()) == n:
            break
        h *= 2
    return sa.astype(np.int32 if n < 2**31 else np.int64)


def build(docs, out: str | Path, meta: dict | None = None, sort_depth: int = 64) -> "Datastore":
    out = Path(out)
    if sort_depth < 1:
        raise DatastoreError(f"sort_depth must be >= 1, got {sort_depth}")
    tokens = concat_docs(docs)
    sa = suffix_array(tokens, sort_depth)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "tokens.npy", tokens)
    np.save(out / "sa.npy", sa)
    m = {
        "format": FORMAT,
        "version": VERSION,
        "n_tokens": int(tokens.shape[0]),
        "n_docs": int((tokens < 0).sum()),
        "sort_depth": int(sort_depth),
        **(meta or {}),
    }
    (out / "meta.json").write_text(json.dumps(m, indent=1))
    return Datastore(out)


class Datastore:
    def __init__(self, path: str | Path, vocab_size: int | None = None, tokenizer_hash: str | None = None):
        p = Path(path)
        if not p.is_dir():
            raise DatastoreError(
                f"datastore {p} not found (build one with: specdraft datastore build CORPUS.jsonl --target NAME -o {p})"
            )
        try:
            meta = json.loads((p / "meta.json").read_text())
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                raise DatastoreError(f"datastore {p}: meta.json is not a {FORMAT} manifest")
            if meta.get("version") != VERSION:
                raise DatastoreError(f"datastore {p}: format version {meta.get('version')!r}, expected {VERSION}")
            tokens = np.load(p / "tokens.npy", mmap_mode="r", allow_pickle=False)
            sa = np.load(p / "sa.npy", mmap_mode="r", allow_pickle=False)
        except DatastoreError:
            raise
        except (OSError, ValueError, json.JSONDecodeError) as e:
            raise DatastoreError(f"datastore {p} is missing a file or corrupt: {e}") from None
        if tokens.dtype != np.int32 or tokens.ndim != 1 or sa.ndim != 1 or sa.dtype not in (np.int32, np.int64):
            raise DatastoreError(f"datastore {p} is corrupt: unexpected array dtypes/shapes")
        if tokens.shape[0] != meta.get("n_tokens") or sa.shape[0] != tokens.shape[0] or tokens.shape[0] == 0:
            raise DatastoreError(
                f"datastore {p} is corrupt: {tokens.shape[0]} tokens, {sa.shape[0]} suffix array "
                f"entries, manifest says {meta.get('n_tokens')}"
            )
        if tokens[-1] != -1:
            raise DatastoreError(f"datastore {p} is corrupt: the token array does not end with the separator -1")
        if vocab_size is not None and meta.get("vocab_size") is not None and meta["vocab_size"] > vocab_size:
            raise DatastoreError(
                f"datastore {p} was built for a vocabulary of {meta['vocab_size']} tokens; the target has {vocab_size}"
            )
        if tokenizer_hash is not None and meta.get("tokenizer_sha256") not in (None, tokenizer_hash):
            raise DatastoreError(
                f"datastore {p} was built with another tokenizer ({meta.get('target')!r}); rebuild it "
                "with --target set to this target"
            )
        self.path: Path | None = p  # None: made in memory (of_docs)
        self.meta, self.tokens, self.sa = meta, tokens, sa
        self.sort_depth = int(meta.get("sort_depth", 64))

    @classmethod
    def of_docs(cls, docs, sort_depth: int = 64) -> "Datastore":
        """A datastore in memory over token documents (``ServedOutputs``' snapshots), searched as one on disk."""
        self = cls.__new__(cls)
        self.tokens = concat_docs(docs)
        self.sa = suffix_array(self.tokens, sort_depth)
        self.path, self.sort_depth = None, sort_depth
        self.meta = {
            "format": FORMAT,
            "version": VERSION,
            "n_tokens": int(self.tokens.shape[0]),
            "sort_depth": sort_depth,
        }
        return self

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def _cmp_bound(self, pat: list[int], upper: bool) -> int:
        """First suffix-array index whose suffix's first len(pat) tokens are >= pat (> for upper)."""
        lo, hi, m, toks, sa = 0, self.sa.shape[0], len(pat), self.tokens, self.sa
        while lo < hi:
            mid = (lo + hi) // 2
            s = int(sa[mid])
            seg = toks[s : s + m].tolist()
            if seg < pat or (upper and seg == pat):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def range_of(self, pat: list[int]) -> tuple[int, int]:
        lo = self._cmp_bound(pat, False)
        return lo, self._cmp_bound(pat, True)

    def lookup(self, context: list[int], limit: int, max_len: int | None = None) -> tuple[int, np.ndarray]:
        """(m, end positions): the longest suffix of ``context`` (at most sort_depth tokens, and at most
        ``max_len`` when the caller knows a bound) found in the corpus, and the corpus positions of
        its last token in up to ``limit`` occurrences (evenly spaced over the suffix array range)."""
        lo_m, hi_m = 0, min(len(context), self.sort_depth, len(context) if max_len is None else max_len)
        rng = (0, 0)
        while lo_m < hi_m:  # invariant: length lo_m occurs; find the largest m that does
            mid = (lo_m + hi_m + 1) // 2
            r = self.range_of(context[len(context) - mid :])
            if r[1] > r[0]:
                lo_m, rng = mid, r
            else:
                hi_m = mid - 1
        if lo_m == 0:
            return 0, np.empty(0, dtype=np.int64)
        a, b = rng
        if b - a > limit:
            idx = a + (np.arange(limit, dtype=np.int64) * (b - a)) // limit
        else:
            idx = np.arange(a, b, dtype=np.int64)
        return lo_m, np.asarray(self.sa[idx], dtype=np.int64) + lo_m - 1


class ServedOutputs:
    """The outputs a decoder served lately (when it learns online: specdraft/learning), for the suffix drafter
    to draft from as from a datastore: SuffixDecoding's global tree over earlier answers, which pays when
    requests repeat each other's text (agents, templated answers). Bounded: past ``max_tokens`` the oldest
    outputs leave. A request's drafter reads the snapshot of when it began. Snapshots are rebuilt in a
    thread of their own after outputs were added (a suffix array: 44 ms for 65k tokens on a busy 2-core
    AMD EPYC, 2026-12-05), not on the serving loop, so a request may not see yet an output that finished
    just before it."""

    def __init__(self, max_tokens: int, sort_depth: int = 64):
        self.max_tokens, self.sort_depth = max_tokens, sort_depth
        self.docs: deque[np.ndarray] = deque()
        self.n_tokens = 0
        self._snapshot: Datastore | None = None
        self._stale = False
        self._builder: threading.Thread | None = None
        self._lock = threading.Lock()

    def add(self, tokens: list[int]) -> None:
        doc = np.asarray(tokens, dtype=np.int32)
        if doc.size < 2:
            return
        with self._lock:
            self.docs.append(doc[-self.max_tokens :])
            self.n_tokens += len(self.docs[-1]) + 1
            while self.n_tokens > self.max_tokens + 1 and len(self.docs) > 1:
                self.n_tokens -= len(self.docs.popleft()) + 1
            self._stale = True
            if self._builder is None:
                self._builder = threading.Thread(target=self._build, name="served-outputs", daemon=True)
                self._builder.start()

    def _build(self) -> None:
        while True:
            with self._lock:
                docs, self._stale = list(self.docs), False
            snap = Datastore.of_docs(docs, self.sort_depth)
            with self._lock:
                self._snapshot = snap
                if not self._stale:
                    self._builder = None
                    return

    def snapshot(self) -> "Datastore | None":
        """The latest snapshot (None until one is built)."""
        with self._lock:
            return self._snapshot

    def wait(self) -> None:
        """Until the snapshot holds every output added so far (tests, measurements)."""
        with self._lock:
            builder = self._builder
        if builder is not None:
            builder.join()


def read_corpus(path: str | Path, max_docs: int | None = None) -> list[str]:
    """Texts from a jsonl corpus: each line's ``text``, ``prompt`` or ``turns`` (a list of strings,
    each turn a document)."""
    p = Path(path)
    texts: list[str] = []
    for i, r in iter_jsonl(p, DatastoreError, "corpus"):
        if isinstance(r.get("text"), str):
            texts.append(r["text"])
        elif isinstance(r.get("prompt"), str):
            texts.append(r["prompt"])
        elif isinstance(r.get("turns"), list) and all(isinstance(t, str) for t in r["turns"]):
            texts.extend(r["turns"])
        else:
            raise DatastoreError(f"{p}:{i}: no text (need a 'text' or 'prompt' string or a 'turns' list of strings)")
        if max_docs is not None and len(texts) >= max_docs:
            break
    if not texts:
        raise DatastoreError(f"corpus {p} has no documents")
    return texts[:max_docs] if max_docs is not None else texts


def build_from_jsonl(
    corpus: str | Path, target: str, out: str | Path, sort_depth: int = 64, max_docs: int | None = None
) -> Datastore:
    """Tokenize a jsonl corpus with ``target``'s tokenizer and build the store at ``out``."""
    from ..models.loading import load_tokenizer

    texts = read_corpus(corpus, max_docs)
    tok = load_tokenizer(target)
    docs = tok(texts, add_special_tokens=False)["input_ids"]
    meta = {"target": target, "vocab_size": len(tok), "tokenizer_sha256": tokenizer_sha256(tok), "corpus": str(corpus)}
    return build(docs, out, meta, sort_depth=sort_depth)
