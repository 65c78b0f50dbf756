"""Training data every head kind shares: the target's own answers and features, recorded while the
engine decodes them (``FeatureRecorder``), and the draft-vocabulary rule.

Medusa and EAGLE (``--data PROMPTS.jsonl``) keep their data in DIR/data.pt: per sequence its tokens
(prompt + the target's greedy answer, chat template unless ``--no-chat``), the prompt's length and the
final-norm features of every fed position [T - 1, H] (the last token is never fed). ``--ray`` answers
the same batches on Ray worker actors (bench/shard.py's data_builder, in RAY_BUILDERS). EAGLE-3 keeps appended,
resumable data of its own (eagle3_data.py).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from ...core.errors import SpecDraftError
from ...drafters.base import NoDrafter
from .loop import load_saved, progress

DATA_FILE = "data.pt"
DATA_BATCH = 16  # prompts per batch of the training data (a local run and each Ray job alike)


class FeatureRecorder(NoDrafter):
    """Plain decoding that keeps the target's features of every token it feeds: the prompt's (handed
    over with the first step) and each step's pending token. ``cols``: the columns wanted."""

    name = "plain"
    wants_hidden = True

    def __init__(self, cols: torch.Tensor):
        self.cols = cols
        self.parts: list[torch.Tensor] = []

    def observe(self, step) -> None:
        self.parts.append(step.hidden[:, self.cols].to(torch.bfloat16))

    def features(self) -> torch.Tensor:
        return torch.cat(self.parts) if self.parts else torch.empty(0, self.cols.numel(), dtype=torch.bfloat16)


def block_columns(target, blocks) -> torch.Tensor:
    H = target.facts.hidden_size
    return torch.cat([torch.arange(b * H, (b + 1) * H) for b in blocks])


def decode_stream(target, jobs, rows: int, on_done) -> None:
    """Decode jobs (``engine.Job``s, each tagged by its caller) with at most ``rows`` at once, a waiting job
    joining as soon as a row finishes (so one long answer does not hold a batch of finished ones) and
    there is room in a shared, bounded cache for all it may write (llama.cpp's rows share n_ctx cells);
    ``on_done(tag, prompt ids, result, drafter)`` as each finishes. Jobs may be an iterator. Seeded rows
    share the batch's forwards (data needs no batch-invariant samples, and own lanes would cost a
    forward each)."""
    from ...engine import Engine

    eng = Engine(target, target.eos_token_ids(), isolate_seeded=False)
    waiting = iter(jobs)
    held, claimed = None, {}  # a job that waits for room; row -> the cells it may fill
    while True:
        joining = []
        while eng.num_rows + len(joining) < rows:
            job = held if held is not None else next(waiting, None)
            held = None
            if job is None:
                break
            room = eng.kv.draft_room()
            if room is not None and sum(claimed.values()) + sum(map(_cells, joining + [job])) > target.max_context:
                held = job
                break
            joining.append(job)
        for r, job in zip(eng.add_many(joining), joining):
            if isinstance(r, Exception):
                raise r
            claimed[r] = _cells(job)
        if not eng.rows:
            if held is None:
                return
            raise SpecDraftError(
                f"a prompt of {len(held.prompt_ids)} tokens with {held.sampling.max_new_tokens} new "
                f"ones does not fit {target.name}'s context of {target.max_context} tokens"
            )
        for row in eng.step():
            claimed.pop(row, None)
            if row.error is not None:
                raise row.error
            on_done(row.tag, row.prompt_ids, row.result, row.drafter)


def _cells(job) -> int:
    """The cache cells a job may fill: its prompt, its new tokens and one pending."""
    return len(job.prompt_ids) + job.sampling.max_new_tokens + 1


def recorded(ids: list[int], result, recorder: FeatureRecorder) -> tuple[list[int], torch.Tensor]:
    """(prompt + answer tokens, features [len - 1, cols] bf16 of every fed position) of a finished job."""
    tokens = ids + result.token_ids
    x = recorder.features()[: len(tokens) - 1]
    if x.shape[0] != len(tokens) - 1:
        raise SpecDraftError(f"{x.shape[0]} feature rows for {len(tokens) - 1} fed tokens")
    return tokens, x


def decode_recording(
    target, jobs: list[tuple[list[int], object]], cols: torch.Tensor
) -> list[tuple[list[int], torch.Tensor]]:
    """(prompt ids, SamplingParams) jobs decoded together with plain steps; -> per job (prompt + answer
    tokens, features [len - 1, len(cols)] bf16 of every fed position)."""
    done: dict[int, tuple] = {}
    from ...engine import Job

    decode_stream(
        target,
        [Job(ids, sp, FeatureRecorder(cols), tag=j) for j, (ids, sp) in enumerate(jobs)],
        len(jobs),
        lambda j, ids, res, rec: done.__setitem__(j, recorded(ids, res, rec)),
    )
    return [done[j] for j in range(len(jobs))]


def draft_vocab(tokens: list[torch.Tensor], n_prompt: list[int], n: int, vocab: int) -> tuple[torch.Tensor, float]:
    """The n most frequent answer tokens (ties: the lower id), sorted: a head's draft vocabulary; -> (ids,
    the share of the answer tokens they cover)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for toks, n0 in zip(tokens, n_prompt):
        counts += torch.bincount(toks[n0:], minlength=vocab)[:vocab]
    order = torch.sort(counts, descending=True, stable=True).indices[: min(n, vocab)]
    covered = float(counts[order].sum()) / max(float(counts.sum()), 1.0)
    return torch.sort(order).values, covered


# --- DIR/data.pt (Medusa, EAGLE) ---------------------------------------------------------------------
def encode_prompts(
    dec, prompts: list[str], max_new_tokens: int, chat: bool, max_prompt_tokens: int | None = None
) -> list[list[int]]:
    """The prompts' token ids that fit the target's context (and ``max_prompt_tokens``), shortest first."""
    encoded = [dec.encode(p, chat=chat) for p in prompts]
    encoded = [
        ids
        for ids in encoded
        if len(ids) + max_new_tokens <= dec.target.max_context
        and (max_prompt_tokens is None or len(ids) <= max_prompt_tokens)
    ]
    encoded.sort(key=len)
    return encoded


def answer_batch(dec, chunk: list[list[int]], max_new_tokens: int) -> list[dict]:
    """One batch of encoded prompts: the target's greedy answers and final-norm features, in one pass."""
    from ...core.config import SamplingParams

    target = dec.target
    if not target.capabilities.hidden:
        raise SpecDraftError(
            f"{target.name} on the {target.backend} backend hands over no final-norm features; "
            "Medusa and EAGLE data need --backend hf"
        )
    done = decode_recording(
        target, [(c, SamplingParams(max_new_tokens=max_new_tokens)) for c in chunk], block_columns(target, [0])
    )
    return [
        {"tokens": torch.tensor(t, dtype=torch.long), "hidden": x, "n_prompt": len(c)} for c, (t, x) in zip(chunk, done)
    ]


def build_data(
    dec,
    prompts: list[str],
    max_new_tokens: int,
    chat: bool,
    batch: int | None = None,
    max_prompt_tokens: int | None = None,
) -> list[dict]:
    """The target's greedy answers and features (module doc), ``batch`` prompts of similar length per
    batch; prompts longer than ``max_prompt_tokens`` are skipped."""
    batch = batch or DATA_BATCH
    encoded = encode_prompts(dec, prompts, max_new_tokens, chat, max_prompt_tokens)
    seqs = []
    bar = progress(total=len(encoded), desc="target answers", unit="prompt")
    for i in range(0, len(encoded), batch):
        seqs += answer_batch(dec, encoded[i : i + batch], max_new_tokens)
        bar.update(len(encoded[i : i + batch]))
    bar.close()
    return seqs


def _check_seqs(seqs, target, f: Path) -> None:
    """Cached sequences as build_data makes them for ``target`` (its width, its vocabulary)."""
    hidden, vocab = target.facts.hidden_size, target.vocab_size

    def ok(s) -> bool:
        if not (
            isinstance(s, dict)
            and torch.is_tensor(s.get("tokens"))
            and torch.is_tensor(s.get("hidden"))
            and isinstance(s.get("n_prompt"), int)
        ):
            return False
        t, h = s["tokens"], s["hidden"]
        return (
            t.dtype == torch.long
            and t.dim() == 1
            and t.numel() > 1
            and 0 <= int(t.min()) <= int(t.max()) < vocab
            and h.is_floating_point()
            and tuple(h.shape) == (t.numel() - 1, hidden)
            and 0 <= s["n_prompt"] <= t.numel()
        )

    if not isinstance(seqs, list) or not all(ok(s) for s in seqs):
        raise SpecDraftError(f"cached training data {f} is not what specdraft train writes for this target; delete it")


def load_or_build_data(
    dec,
    out: Path,
    data_path: str,
    target_name: str,
    max_new_tokens: int,
    chat: bool,
    max_prompts: int | None,
    max_prompt_tokens: int | None = None,
    build=build_data,
) -> tuple[list[dict], dict]:
    """The cached data if it was made with these settings, else ``build``'s (build_data, or on Ray
    bench/shard.py's data_builder's), saved in DIR/data.pt."""
    f = out / DATA_FILE
    want = {
        "target": target_name,
        "data": str(data_path),
        "max_new_tokens": max_new_tokens,
        "chat": chat,
        "max_prompts": max_prompts,
        "features": "fed positions",
    }
    if max_prompt_tokens is not None:  # only when set, so data cached before this option still matches
        want["max_prompt_tokens"] = max_prompt_tokens
    if f.exists():
        blob = load_saved(f, "cached training data")
        if blob.get("meta") == want:
            _check_seqs(blob.get("seqs"), dec.target, f)
            print(f"reusing cached training data {f} ({len(blob['seqs'])} sequences)", file=sys.stderr)
            return blob["seqs"], blob["meta"]
        print(f"cached data {f} was made with {blob.get('meta')}; regenerating for {want}", file=sys.stderr)
    from ...core.prompts import load_prompts

    rows = load_prompts(data_path)
    if max_prompts:
        rows = rows[:max_prompts]
    if not rows:
        raise SpecDraftError(f"{data_path} holds no prompts")
    t0 = time.perf_counter()
    seqs = build(dec, [r["prompt"] for r in rows], max_new_tokens, chat, max_prompt_tokens=max_prompt_tokens)
    if not seqs:
        raise SpecDraftError(
            f"no prompt of {data_path} fits the target's context with {max_new_tokens} new tokens"
            + (f" and --max-prompt-tokens {max_prompt_tokens}" if max_prompt_tokens else "")
        )
    meta = {
        **want,
        "n_seqs": len(seqs),
        "n_tokens": int(sum(s["tokens"].numel() for s in seqs)),
        "build_s": round(time.perf_counter() - t0, 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"training data: {meta['n_seqs']} sequences, {meta['n_tokens']} tokens, built in {meta['build_s']} s",
        file=sys.stderr,
    )
    torch.save({"meta": want, "seqs": seqs, "stats": meta}, out / (DATA_FILE + ".tmp"))
    (out / (DATA_FILE + ".tmp")).replace(f)
    return seqs, want
