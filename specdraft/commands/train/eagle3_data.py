"""EAGLE-3 training data, made in one batched pass on the target that serves.

Stages, each appended after every batch and continued by the next run (DIR/data/):

1. prompts (``synth.jsonl``): Magpie. The chat template up to the user's text (with one of a few
   generic system prompts, to spread the topics) is fed alone, so the instruct model writes a user
   turn; draws are batched, at mixed temperatures, seeded by their draw number. A draw is kept if it
   ended (EOS, not the token limit), holds at least 8 characters, is new (case and spacing ignored)
   and shares no 8-word run with a benchmark prompt (Spec-Bench, the code edits).
2. answers and features (``answers.jsonl``, ``features.bin`` + ``features.jsonl``): the target
   answers ``rows`` prompts per forward with plain decoding (most greedy, some sampled), and every
   forward hands over the three layers' outputs of the tokens it fed (the backend's feature hand-over:
   hooks, IR outputs or llama.cpp's graph callback), recorded by ``FeatureRecorder``. One pass: no
   second forward over prompt + answer.
3. features for answers that have none (a new machine given only the token ids): a batched prefill of
   prompt + answer on the same backend.

Features are bf16 rows [tokens, 3H]; position t's row is what the target computed when it fed token
t, for t = 0 .. T - 2 (the last token is never fed). ``features.jsonl`` is written after its rows; rows
past the last index line (a stopped run's) are cut off before appending.
"""

from __future__ import annotations

import json
import os
import re
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ...core.errors import ConfigError, SpecDraftError
from ...core.jsonl import AppendedJsonl
from ...drafters.base import NoDrafter
from .data import FeatureRecorder, block_columns, decode_stream, recorded
from .loop import progress

# Generic system prompts that spread Magpie's topics (none is taken from a benchmark); None: the
# template's own default system prompt.
SYSTEM_PROMPTS = (
    None,
    "You are a helpful assistant.",
    "You are a knowledgeable assistant who answers questions about science, history and everyday life.",
    "You are a writing assistant: you help people write, edit, summarize and translate texts.",
    "You are a patient tutor for mathematics and logical reasoning.",
    "You are an expert software engineer who helps with code in many languages.",
    "You are an assistant that helps people plan, compare options and make decisions.",
)
SYNTH_TEMPERATURES = (0.8, 1.0, 1.2)
ANSWER_SAMPLED_EVERY = 4  # one answer in 4 is sampled (temperature 0.8), the rest greedy
ANSWER_TEMPERATURE = 0.8
NGRAM = 8  # words in a run shared with a benchmark prompt that rejects a synthesized prompt


def feature_columns(target, layers) -> torch.Tensor:
    """The columns of ``target``'s handed-over features that hold ``layers`` (registering them)."""
    if not target.capabilities.layers:
        raise ConfigError(
            f"{target.name} on the {target.backend} backend does not hand over its layers' outputs; "
            "EAGLE-3 data needs a backend that does (hf, llama, openvino)"
        )
    return block_columns(target, target.add_feature_layers(layers))


# --- append-only files ----------------------------------------------------------------------------
# the appended files and the fields every row of each has (core.jsonl.AppendedJsonl: a torn last line,
# left by a stopped run, is cut off before the next append)
SYNTH_FIELDS, ANSWER_FIELDS, FEATURE_FIELDS = ("draw", "text", "kept"), ("i", "tokens", "n_prompt"), ("i", "row", "n")


def tokens_crc(tokens: list[int]) -> int:
    return zlib.crc32(json.dumps(tokens).encode())


def current_features(index: list[dict], answers: dict[int, dict]) -> dict[int, dict]:
    """Answer i -> the index row of its features: the last one written for it, made from the answer's
    tokens as they are now (an answer lost with a torn line is made again, and can come out different)."""
    out = {}
    for r in index:
        a = answers.get(r["i"])
        if a is not None and r["n"] == len(a["tokens"]) - 1 and r.get("crc") == tokens_crc(a["tokens"]):
            out[r["i"]] = r
    return out


class FeatureStore:
    """``features.bin`` (bf16 rows) and its index ``features.jsonl`` ({i, row, n}); see the module doc."""

    def __init__(self, data: Path, width: int):
        self.bin, self.width = data / "features.bin", width
        self.index = AppendedJsonl(data / "features.jsonl", need=FEATURE_FIELDS)
        self.rows = max((r["row"] + r["n"] for r in self.index.rows), default=0)  # where the indexed rows end
        self.bin.parent.mkdir(parents=True, exist_ok=True)
        size = self.bin.stat().st_size if self.bin.exists() else 0
        if size < self.rows * width * 2:
            raise SpecDraftError(
                f"{self.bin} holds {size} bytes, less than the {self.rows * width * 2} that "
                f"{self.index.path} names; delete both to make the features again"
            )
        with open(self.bin, "ab") as f:
            f.truncate(self.rows * width * 2)

    def current(self, answers: dict[int, dict]) -> dict[int, dict]:
        return current_features(self.index.rows, answers)

    def append(self, i: int, tokens: list[int], x: torch.Tensor) -> None:
        if x.shape[1] != self.width:
            raise SpecDraftError(f"features of width {x.shape[1]}, the store holds {self.width}")
        with open(self.bin, "ab") as f:
            f.write(x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        self.index.append([{"i": i, "row": self.rows, "n": int(x.shape[0]), "crc": tokens_crc(tokens)}])
        self.rows += int(x.shape[0])


# --- 1. prompts -----------------------------------------------------------------------------------
def _words(s: str) -> list[str]:
    return re.findall(r"\w+", s.lower())


def benchmark_ngrams() -> set[tuple[str, ...]]:
    """Every run of NGRAM words of the shipped benchmark prompts (Spec-Bench's turns, the code edits)."""
    from ...core.prompts import PRESET_FILES, SPEC_BENCH, load_prompts

    grams: set[tuple[str, ...]] = set()
    for f in (SPEC_BENCH, *PRESET_FILES.values()):
        for r in load_prompts(f):
            for text in [r["prompt"], *r.get("turns", [])]:
                w = _words(text)
                grams.update(tuple(w[i : i + NGRAM]) for i in range(len(w) - NGRAM + 1))
    return grams


def overlaps(text: str, grams: set) -> bool:
    w = _words(text)
    return any(tuple(w[i : i + NGRAM]) in grams for i in range(len(w) - NGRAM + 1))


def user_prefix(tokenizer, system: str | None) -> list[int]:
    """The chat template up to where the user's text starts: what Magpie feeds an instruct model so
    that it writes a user turn (``system`` None: the template's default system prompt)."""
    mark = "\u2063MAGPIE\u2063"
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": mark}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    if mark not in text:
        raise ConfigError("the target's chat template does not show the user's text; --synth needs one")
    return [int(t) for t in tokenizer(text[: text.index(mark)], add_special_tokens=False)["input_ids"]]


@dataclass(frozen=True)
class Draw:
    """Magpie draw number ``n``: its system prompt, temperature and seed follow from n alone, so a
    resumed run continues the same sequence of draws."""

    n: int
    seed: int

    @property
    def system(self) -> int:
        return self.n % len(SYSTEM_PROMPTS)

    @property
    def temperature(self) -> float:
        return SYNTH_TEMPERATURES[(self.n // len(SYSTEM_PROMPTS)) % len(SYNTH_TEMPERATURES)]

    @property
    def sampling_seed(self) -> int:
        return self.seed * 1_000_003 + self.n


def norm_text(s: str) -> str:
    return " ".join(s.lower().split())


SYNTH_TRIES = 20  # draws per wanted prompt before synthesis gives up (a model that never ends a turn)


def synth_prompts(gen, tokenizer, want: int, data: Path, rows: int, max_tokens: int, seed: int) -> list[str]:
    """``want`` distinct prompts written by the target (module doc, stage 1), at most ``rows`` drawn at once,
    each draw logged as it finishes; continues synth.jsonl at the draw after its last."""
    from ...core.config import SamplingParams
    from ...engine import Job

    log = AppendedJsonl(data / "synth.jsonl", need=SYNTH_FIELDS)
    kept = [d["text"] for d in log.rows if d["kept"]]
    seen = {norm_text(t) for t in kept}
    grams = benchmark_ngrams()
    prefixes = [user_prefix(tokenizer, s) for s in SYSTEM_PROMPTS]
    first = max((d["draw"] for d in log.rows), default=-1) + 1
    bar = progress(total=want, initial=min(len(kept), want), desc="synthesize prompts", unit="prompt")

    def draws():
        n = first
        while len(kept) < want:
            if n - first >= SYNTH_TRIES * want + rows:
                raise SpecDraftError(
                    f"only {len(kept)} of {n} synthesized prompts ended within {max_tokens} tokens "
                    "and were new; raise --synth-max-tokens or pass --data PROMPTS.jsonl"
                )
            d = Draw(n, seed)
            sp = SamplingParams(temperature=d.temperature, seed=d.sampling_seed, max_new_tokens=max_tokens)
            yield Job(prefixes[d.system], sp, NoDrafter(), tag=d)
            n += 1

    def done(d, ids, result, drafter):
        text = tokenizer.decode(result.token_ids, skip_special_tokens=True).strip()
        take = (
            result.stats.finish_reason != "length"
            and len(text) >= 8
            and norm_text(text) not in seen
            and not overlaps(text, grams)
            and len(kept) < want
        )
        if take:
            seen.add(norm_text(text))
            kept.append(text)
            bar.update(1)
        log.append([{"draw": d.n, "system": d.system, "temperature": d.temperature, "text": text, "kept": take}])

    decode_stream(gen, draws(), rows, done)
    bar.close()
    return kept[:want]


# --- 2. answers with their features -----------------------------------------------------------------
def answer_sampling(i: int, max_new_tokens: int, seed: int):
    """Prompt i's answer: greedy, or sampled for one prompt in ANSWER_SAMPLED_EVERY (seeded by i)."""
    from ...core.config import SamplingParams

    if i % ANSWER_SAMPLED_EVERY == ANSWER_SAMPLED_EVERY - 1:
        return SamplingParams(temperature=ANSWER_TEMPERATURE, seed=seed * 1_000_003 + i, max_new_tokens=max_new_tokens)
    return SamplingParams(max_new_tokens=max_new_tokens)


def answer_with_features(
    gen, encoded: list[tuple[int, list[int]]], data: Path, layers, rows: int, max_new_tokens: int, seed: int
) -> dict:
    """Answers and features of every (prompt index, prompt ids) not in answers.jsonl yet (module doc,
    stage 2), shortest prompts first, at most ``rows`` decoding at once; each answer is written as it
    finishes. -> {"tokens": answer tokens made, "seconds": wall time}."""
    from ...engine import Job

    answers = AppendedJsonl(data / "answers.jsonl", need=ANSWER_FIELDS)
    cols = feature_columns(gen, layers)
    store = FeatureStore(data, cols.numel())
    todo = unanswered(data, encoded)
    bar = progress(
        total=len(answers.rows) + len(todo),
        initial=len(answers.rows),
        desc=f"answers + features ({gen.backend})",
        unit="prompt",
    )
    t0, made = time.perf_counter(), [0]

    def done(i, ids, result, recorder):
        tokens, x = recorded(ids, result, recorder)
        store.append(i, tokens, x)  # features first: an answer row always finds its features
        answers.append([answer_row(i, ids, tokens)])
        made[0] += len(tokens) - len(ids)
        bar.set_postfix(tok_s=f"{made[0] / (time.perf_counter() - t0):.1f}")
        bar.update(1)

    jobs = (Job(ids, answer_sampling(i, max_new_tokens, seed), FeatureRecorder(cols), tag=i) for i, ids in todo)
    decode_stream(gen, jobs, rows, done)
    bar.close()
    return {"tokens": made[0], "seconds": round(time.perf_counter() - t0, 1)}


def answer_row(i: int, ids: list[int], tokens: list[int]) -> dict:
    """answers.jsonl's row of prompt ``i`` (``ids``) answered as ``tokens`` (prompt + answer)."""
    return {
        "i": i,
        "tokens": tokens,
        "n_prompt": len(ids),
        "sampled": i % ANSWER_SAMPLED_EVERY == ANSWER_SAMPLED_EVERY - 1,
    }


def unanswered(data: Path, encoded: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
    """The (prompt index, prompt ids) that answers.jsonl has no answer for, shortest first."""
    have = {r["i"] for r in AppendedJsonl(data / "answers.jsonl", need=ANSWER_FIELDS).rows}
    return sorted([(i, ids) for i, ids in encoded if i not in have], key=lambda x: len(x[1]))


def answer_rows(gen, encoded: list[tuple[int, list[int]]], rows: int, max_new_tokens: int, seed: int) -> list[dict]:
    """The answers of ``encoded`` without features (a Ray worker's share of stage 2: the driver adds the
    features with stage 3's prefill), at most ``rows`` decoding at once, in the order given."""
    from ...drafters.base import NoDrafter
    from ...engine import Job

    out: dict[int, dict] = {}

    def done(i, ids, result, _drafter):
        out[i] = answer_row(i, ids, ids + result.token_ids)

    jobs = [Job(ids, answer_sampling(i, max_new_tokens, seed), NoDrafter(), tag=i) for i, ids in encoded]
    decode_stream(gen, jobs, rows, done)
    return [out[i] for i, _ in encoded]


# --- 3. features of answers that have none -----------------------------------------------------------
def prefill_features(gen, answers: list[dict], data: Path, layers, rows: int) -> None:
    """Features of answered sequences that have none (or stale ones), ``rows`` sequences per batched prefill."""
    cols = feature_columns(gen, layers)
    store = FeatureStore(data, cols.numel())
    have = store.current({a["i"]: a for a in answers})
    todo = [a for a in answers if a["i"] not in have]
    if not todo:
        return
    bar = progress(total=sum(len(a["tokens"]) for a in todo), desc=f"features ({gen.backend} prefill)", unit="tok")
    for b in range(0, len(todo), rows):
        chunk = todo[b : b + rows]
        kv = gen.new_rows()
        kv.add_rows([a["tokens"][:-1] for a in chunk], hidden=True)
        for a, h in zip(chunk, kv.prefill_hidden):
            store.append(a["i"], a["tokens"], h[:, cols].to(torch.bfloat16))
            bar.update(len(a["tokens"]))
        kv.remove_rows(list(range(len(chunk))))
    bar.close()
