"""``specdraft bench --preset multiturn``: conversations as chat clients and agents send them, each turn the
whole history again, against peers that keep their own caches.

Workloads: Spec-Bench's two-turn MT-bench conversations (``--n-per-task`` per category, 10 each), and an
agent-like trace written for it from each code_edit module (bench/code_edit.jsonl): the edit asked there,
then follow-up edits, each step resending the file as it is on disk and the whole history (``AGENT_STEPS``).

Fair by construction, as ``specdraft bench``: one process, the same token ids for every method, each
conversation run by every method in turn (A B C per conversation) after a warm-up of each, greedy. A
conversation's history is built once from the first method's answers (token ids), so every method sees the
same prompts; every method starts each conversation with an empty cache of its own (specdraft's prefix
cache emptied, llama.cpp's ``Llama`` reset), so turn 1 is cold and later turns find what this method left.

Methods: specdraft's (``plain``, ``auto``, ``prompt_lookup``, ...; ``METHOD[cold]`` empties the cache before
every turn: the engine without a prefix cache), llama-cpp-python's ``Llama`` on the same GGUF file keeping its
longest cached prefix between turns (``llama_cpp``; its server works so) and reset before every turn
(``llama_cpp[cold]``). Per turn: time to first token, the decode phase's tokens/s (after the first token),
end-to-end tokens/s and the prompt tokens taken from a cache.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..core import prompts as data
from ..core.config import SamplingParams, SpecConfig
from ..core.errors import SpecDraftError
from ..core.metrics import FirstToken

SPEC_BENCH_TWO_TURN = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
AGENT_STEPS = (
    "Now add a short docstring to every function or class that has none. Return the complete file in one code block.",
    "Now make every error message more specific (name the value that was wrong). Return the complete file in one "
    "code block.",
    "Now add a small usage example at the end, guarded by if __name__ == '__main__'. Return the complete file in "
    "one code block.",
)
DEFAULT_METHODS = "plain,plain[cold],auto,llama_cpp,llama_cpp[cold]"


@dataclass(frozen=True)
class MultiturnOptions:
    target: str = "qwen2.5-coder-1.5b:Q4_0"
    backend: str = "llama"
    methods: str = DEFAULT_METHODS
    n_per_task: int = 1  # two-turn conversations per MT-bench category
    agent: int = 2  # agent traces (one per code_edit module, first ones)
    max_new_tokens: int = 128
    threads: int | None = None
    out: str = "results/multiturn.json"


def conversations(opts: MultiturnOptions) -> list[dict]:
    """[{id, kind, turns: [user message, ...]}]."""
    out = []
    rows = [json.loads(line) for line in (Path(__file__).parent / "spec_bench" / "question.jsonl").open()]
    for cat in SPEC_BENCH_TWO_TURN:
        two = [r for r in rows if r.get("category") == cat and len(r.get("turns", [])) == 2]
        out += [{"id": f"mt{r['question_id']}", "kind": "chat", "turns": r["turns"]} for r in two[: opts.n_per_task]]
    for r in data.load_prompts(Path(__file__).parent / "code_edit.jsonl")[: opts.agent]:
        code = r["prompt"].split("```")[1] if r["prompt"].count("```") >= 2 else r["prompt"]
        again = [f"Here is the file as it is on disk now:\n\n```{code}```\n\n{step}" for step in AGENT_STEPS]
        out.append({"id": f"agent-{r['id']}", "kind": "agent", "turns": [r["prompt"], *again]})
    return out


class EngineMethod:
    def __init__(self, dec, name: str):
        self.name, self.dec = name, dec
        self.cold = name.endswith("[cold]")
        self.spec = SpecConfig.from_dict({"method": name.removesuffix("[cold]")})

    def forget(self) -> None:
        self.dec.forget_prefixes()

    def run(self, ids: list[int], sp: SamplingParams) -> dict:
        if self.cold:
            self.forget()
        first = FirstToken()
        out = self.dec.generate(ids, sampling=sp, spec=self.spec, on_emit=first.on_emit)
        wall = out.stats.wall_s
        return {
            "token_ids": out.token_ids,
            "wall_s": wall,
            "first_token_s": first.seconds(wall),
            "cached": out.stats.cached_tokens,
        }


class LlamaCppMethod:
    def __init__(self, gguf: str, name: str, threads: int, eos_ids: set[int], n_ctx: int):
        from llama_cpp import Llama

        self.name, self.eos_ids = name, eos_ids
        self.cold = name.endswith("[cold]")
        self.llm = Llama(
            model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, flash_attn=True, verbose=False
        )

    def forget(self) -> None:
        self.llm.reset()

    def run(self, ids: list[int], sp: SamplingParams) -> dict:
        from ..models.llama import on_ggml_thread

        return on_ggml_thread(self._run, ids, sp)

    def _run(self, ids: list[int], sp: SamplingParams) -> dict:
        if self.cold:
            self.forget()
        kept = self._common(ids)
        first, new = FirstToken(), []
        t0 = time.perf_counter()
        for t in self.llm.generate(ids, temp=0.0, repeat_penalty=1.0):  # keeps the longest cached prefix
            first.token()
            new.append(int(t))
            if int(t) in self.eos_ids or len(new) >= sp.max_new_tokens:
                break
        wall = time.perf_counter() - t0
        return {"token_ids": new, "wall_s": wall, "first_token_s": first.seconds(wall), "cached": kept}

    def _common(self, ids: list[int]) -> int:
        """The prompt tokens llama-cpp-python will take from its cache (its own longest-prefix rule)."""
        from ..drafters.base import common_prefix

        return common_prefix(list(self.llm._input_ids[: self.llm.n_tokens]), ids[:-1])


def make_methods(opts: MultiturnOptions, dec, threads: int) -> list:
    out = []
    for name in [m.strip() for m in opts.methods.split(",") if m.strip()]:
        base = name.removesuffix("[cold]")
        if base == "llama_cpp":
            if dec.backend != "llama":
                raise SpecDraftError("--preset multiturn: llama_cpp compares with --backend llama")
            out.append(LlamaCppMethod(str(dec.target.gguf), name, threads, dec.eos_ids, dec.target.n_ctx))
        else:
            out.append(EngineMethod(dec, name))
    if not out:
        raise SpecDraftError("--preset multiturn: --methods names none")
    return out


def run_multiturn(opts: MultiturnOptions) -> dict:
    from tqdm import tqdm

    from ..api import SpecDecoder
    from ..models.llama import threads as llama_threads
    from .environment import environment

    dec = SpecDecoder.load(opts.target, backend=opts.backend, threads=opts.threads)
    threads = opts.threads or llama_threads()
    methods = make_methods(opts, dec, threads)
    convs = conversations(opts)
    sp = SamplingParams(max_new_tokens=opts.max_new_tokens)
    warm = dec.encode("Say hello in three languages.", chat=True)
    for m in methods:  # warm-up: each method once, off the record
        m.forget()
        m.run(warm, SamplingParams(max_new_tokens=8))
    records = []
    bar = tqdm(total=len(convs) * len(methods), desc="multiturn", unit="conversation", file=sys.stderr)
    for conv in convs:
        prompts: list[list[int]] = []  # each turn's prompt: built from the first method's answers
        messages: list[dict] = []
        for m in methods:
            m.forget()
            for t, text in enumerate(conv["turns"]):
                if len(prompts) <= t:
                    messages.append({"role": "user", "content": text})
                    prompts.append(_chat_ids(dec, messages))
                rec = m.run(prompts[t], sp)
                if len(messages) == 2 * t + 1:  # the first method's answer enters the history
                    messages.append(
                        {
                            "role": "assistant",
                            "content": dec.tokenizer.decode(rec["token_ids"], skip_special_tokens=True),
                        }
                    )
                records.append(_record(conv, t, m.name, prompts[t], rec))
            bar.update()
    bar.close()
    mark_divergences(records, methods[0].name, dec.target)
    doc = {"settings": opts.__dict__, "environment": environment("GGUF", threads), "records": records}
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(doc, indent=1))
    return doc


def mark_divergences(records: list[dict], reference: str, target) -> None:
    """Each record whose greedy output differs from ``reference``'s on the same turn gets ``divergence``: the
    first position and the target's top-2 logit gap there (a cold prefill of prompt + the reference's tokens
    before it; a near-tie or a bug?)."""
    ref = {(r["conversation"], r["turn"]): r for r in records if r["method"] == reference}
    for r in records:
        want = ref[r["conversation"], r["turn"]]
        if r["method"] == reference or r["token_ids"] == want["token_ids"]:
            continue
        got, exp = r["token_ids"], want["token_ids"]
        pos = next((i for i, (a, b) in enumerate(zip(got, exp)) if a != b), min(len(got), len(exp)))
        rows = target.new_rows()
        ids = r["prompt_ids"] + exp[:pos]
        rows.add_rows([ids[:-1]])
        top = rows.forward([[ids[-1]]], keep=1)[0, -1].topk(2).values
        r["divergence"] = {"position": pos, "top2_gap": float(top[0] - top[1])}


def _chat_ids(dec, messages: list[dict]) -> list[int]:
    ids = dec.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


def _record(conv: dict, turn: int, method: str, prompt: list[int], rec: dict) -> dict:
    n, wall, ttft = len(rec["token_ids"]), rec["wall_s"], rec["first_token_s"]
    return {
        "conversation": conv["id"],
        "kind": conv["kind"],
        "turn": turn,
        "method": method,
        "prompt_tokens": len(prompt),
        "cached_tokens": rec["cached"],
        "new_tokens": n,
        "wall_s": wall,
        "first_token_s": ttft,
        "decode_s": wall - ttft,
        "token_ids": rec["token_ids"],
        "prompt_ids": prompt,
    }


def summary(doc: dict) -> str:
    """Per workload kind, first turns and later turns apart: each method's mean time to first token, decode
    tokens/s (after the first token), end-to-end tokens/s (tokens / wall time, summed) and hit rate (prompt
    tokens from a cache / prompt tokens), with end to end against the fastest peer keeping its cache."""
    recs = doc["records"]
    lines = []
    for kind in sorted({r["kind"] for r in recs}):
        for later in (False, True):
            rows = [r for r in recs if r["kind"] == kind and (r["turn"] > 0) == later]
            if not rows:
                continue
            each = len(rows) // len({r["method"] for r in rows})
            lines += [
                f"\n{kind}, {'later turns' if later else 'first turn'} ({each} each):",
                "| method | TTFT mean s | decode tok/s | end-to-end tok/s | vs llama_cpp (kept) | cached / prompt |",
                "|---|---|---|---|---|---|",
            ]
            by = {}
            for r in rows:
                by.setdefault(r["method"], []).append(r)
            e2e = {m: sum(r["new_tokens"] for r in rs) / sum(r["wall_s"] for r in rs) for m, rs in by.items()}
            ref = e2e.get("llama_cpp")
            for m, rs in by.items():
                dec_tok = sum(r["new_tokens"] - 1 for r in rs) / max(1e-9, sum(r["decode_s"] for r in rs))
                ttft = sum(r["first_token_s"] for r in rs) / len(rs)
                hit = sum(r["cached_tokens"] for r in rs) / max(1, sum(r["prompt_tokens"] for r in rs))
                vs = f"{e2e[m] / ref:.2f}x" if ref else "n/a"
                lines.append(f"| {m} | {ttft:.2f} | {dec_tok:.2f} | {e2e[m]:.2f} | {vs} | {100 * hit:.1f}% |")
    ref = next(iter({r["method"]: 0 for r in recs}))
    lines.append(f"\nGreedy outputs against {ref}'s (every turn):")
    for m in {r["method"]: 0 for r in recs}:
        rs = [r for r in recs if r["method"] == m]
        gaps = [r["divergence"]["top2_gap"] for r in rs if "divergence" in r]
        if m != ref:
            worst = f", divergences at top-2 gaps <= {max(gaps):.3f}" if gaps else ""
            lines.append(f"- {m}: {len(rs) - len(gaps)}/{len(rs)} identical{worst}")
    return "\n".join(lines)


def main_multiturn(opts: MultiturnOptions) -> int:
    t0 = time.time()
    doc = run_multiturn(opts)
    print(summary(doc))
    print(f"multiturn finished in {time.time() - t0:.0f}s; results: {opts.out}", file=sys.stderr)
    return 0
