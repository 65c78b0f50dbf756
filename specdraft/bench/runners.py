"""Everything the benchmark times is a Runner: ``run(prompt_ids, sp) -> dict`` with ``token_ids``,
``wall_s``, ``first_token_s`` and, where the method has them, per-step ``steps`` ([drafted, accepted, depth]).

``first_token_s`` is the same clock for every runner: the seconds of ``wall_s`` until the first new token
reached the caller through the method's own streaming callback (the engine's ``on_emit``, transformers'
streamer, llama-cpp-python's generator, OpenVINO GenAI's streamer). What follows it is the decode phase
(metrics.decode_phase), which speculation speeds up; what precedes it is mostly the prompt's prefill.

The engine's methods (plain included) run through the same ``engine.generate``; the baselines users
run today (transformers ``generate``, assisted generation, prompt lookup; llama.cpp if installed)
are timed around their own call, on the same token ids.
"""

from __future__ import annotations

import time

import torch

from ..core.config import SamplingParams, SpecConfig
from ..core.metrics import FirstToken
from ..drafters.remote_draft import PREFETCHED


class EngineRunner:
    kind = "engine"

    def __init__(self, name: str, dec, spec: SpecConfig, keep_prefixes: bool = False):
        """``keep_prefixes``: the decoder's prefix cache is kept between runs (a conversation's turns); else
        each run starts cold (the methods compared run the same prompts)."""
        self.name = name
        self.dec = dec
        self.spec = spec.validate()
        self.keep_prefixes = keep_prefixes

    def run(self, ids: list[int], sp: SamplingParams) -> dict:
        first = FirstToken()
        if not self.keep_prefixes:
            self.dec.forget_prefixes()
        out = self.dec.generate(ids, sampling=sp, spec=self.spec, on_emit=first.on_emit)
        return {
            "token_ids": out.token_ids,
            "wall_s": out.stats.wall_s,
            "first_token_s": first.seconds(out.stats.wall_s),
            "prefill_s": out.stats.prefill_s,
            "steps": [[s.drafted, s.accepted, s.positions] for s in out.stats.steps],
            "draft_s": out.stats.draft_s,
            "verify_s": out.stats.verify_s,
            **({"arms": out.stats.arms} if out.stats.arms else {}),  # a composite's steps per arm
            **(
                {"hits": [s.arm == PREFETCHED for s in out.stats.steps]} if PREFETCHED in (out.stats.arms or {}) else {}
            ),
        }


class HFRunner:
    """transformers ``generate``: plain, assisted (``assistant_model``; with a draft of another tokenizer,
    its Universal Assisted Decoding through ``assistant_tokenizer``) or prompt lookup."""

    kind = "baseline"

    def __init__(self, name: str, dec, mode: str, lookup_tokens: int = 10):
        self.name = name
        self.dec = dec
        self.mode = mode
        self.lookup_tokens = lookup_tokens
        if mode == "assisted" and dec.draft is None:
            from ..core.errors import ConfigError

            raise ConfigError(f"{name} needs a draft model (--draft NAME)")
        self.assistant = dec.draft.model if dec.draft is not None else None
        if mode == "assisted" and dec.cross_vocab:
            import copy

            # transformers' UAD, when sampling, swaps the assistant's embeddings for ones pruned to the shared
            # vocabulary, in place: on a copy, so the engine's own draft of the same run stays intact
            self.assistant = copy.deepcopy(dec.draft.model)

    @torch.inference_mode()
    def run(self, ids: list[int], sp: SamplingParams) -> dict:
        model = self.dec.target.model
        x = torch.tensor([ids], device=self.dec.target.device)
        eos = sorted(self.dec.eos_ids)
        kw = dict(
            max_new_tokens=sp.max_new_tokens,
            attention_mask=torch.ones_like(x),
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else 0,
        )
        if sp.greedy:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kw.update(do_sample=True, temperature=sp.temperature, top_k=sp.top_k or None, top_p=sp.top_p)
            if sp.seed is not None:
                torch.manual_seed(sp.seed)
        if self.mode == "assisted":
            kw["assistant_model"] = self.assistant  # transformers' default draft schedule
            if self.dec.cross_vocab:  # Universal Assisted Decoding: transformers re-tokenizes through text
                kw.update(tokenizer=self.dec.tokenizer, assistant_tokenizer=self.dec.draft.tokenizer)
        elif self.mode == "prompt_lookup":
            kw["prompt_lookup_num_tokens"] = self.lookup_tokens
        first = FirstToken()
        kw["streamer"] = _HFStreamer(first)
        t0 = time.perf_counter()
        out = model.generate(x, **kw)
        wall = time.perf_counter() - t0
        new = _until_eos(out[0, len(ids) :].tolist(), self.dec.eos_ids)
        return {"token_ids": new, "wall_s": wall, "first_token_s": first.seconds(wall)}


def _until_eos(new: list[int], eos_ids) -> list[int]:
    """What the engine would emit: up to and including the first EOS."""
    for i, t in enumerate(new):
        if t in eos_ids:
            return new[: i + 1]
    return new


class _HFStreamer:
    """transformers' streamer protocol: ``put`` gets the prompt first, then the new tokens as they come."""

    def __init__(self, first: FirstToken):
        self.first, self.puts = first, 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts > 1:
            self.first.token()

    def end(self) -> None:
        pass


class LlamaCppRunner:
    """llama.cpp's own decoding of the same GGUF file through llama-cpp-python's ``Llama``: plain, its
    prompt-lookup decoding (``LlamaPromptLookupDecoding``), or a draft-model loop (a second ``Llama``
    drafting ``k`` greedy tokens; llama-cpp-python accepts a draft token while the target's sample
    at that position equals it). Flash attention on, as the engine's llama backend runs."""

    kind = "baseline"

    def __init__(
        self,
        name: str,
        gguf_path: str,
        threads: int,
        eos_ids: set[int],
        mode: str = "plain",
        draft_gguf: str | None = None,
        k: int = 10,
    ):
        from llama_cpp import Llama  # ImportError means: skipped

        self.name = name
        self.eos_ids = eos_ids
        draft = None
        if mode == "lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=k)
        elif mode == "draft":
            draft = _LlamaModelDraft(
                Llama(model_path=draft_gguf, n_ctx=4096, n_threads=threads, flash_attn=True, verbose=False), k
            )
        # with a draft model llama-cpp-python keeps every position's logits; logits_all=True sizes that
        # buffer to the context (0.3.36 sizes it to n_batch otherwise and fails past 512 tokens)
        self.llm = Llama(
            model_path=gguf_path,
            n_ctx=4096,
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=True,
            draft_model=draft,
            logits_all=draft is not None,
            verbose=False,
        )

    def run(self, ids: list[int], sp: SamplingParams) -> dict:
        from ..models.llama import on_ggml_thread

        return on_ggml_thread(self._run, ids, sp)  # beside torch's AMX matmuls, ggml's need a thread of their own

    def _run(self, ids: list[int], sp: SamplingParams) -> dict:
        first = FirstToken()
        t0 = time.perf_counter()
        new = []
        self.llm.reset()
        if sp.seed is not None:
            self.llm.set_seed(sp.seed)
        for t in self.llm.generate(
            ids, temp=sp.temperature, top_k=sp.top_k or 0, top_p=sp.top_p, min_p=0.0, repeat_penalty=1.0
        ):
            first.token()
            new.append(int(t))
            if int(t) in self.eos_ids or len(new) >= sp.max_new_tokens:
                break
        wall = time.perf_counter() - t0
        return {"token_ids": new, "wall_s": wall, "first_token_s": first.seconds(wall)}


class _LlamaModelDraft:
    """A draft model for llama-cpp-python's speculative loop: ``k`` greedy tokens of a second Llama,
    reusing its cached prefix between calls."""

    def __init__(self, llm, k: int):
        self.llm = llm
        self.k = k

    def __call__(self, input_ids, **kwargs):
        import numpy as np

        out = []
        for t in self.llm.generate(input_ids.tolist(), temp=0.0, reset=True):  # keeps the longest cached prefix
            out.append(int(t))
            if len(out) >= self.k:
                break
        return np.array(out, dtype=np.intc)


class OVGenAIRunner:
    """OpenVINO GenAI's own decoding of the same GGUF file (the IR the openvino backend converted it to,
    models/openvino.py): plain (``LLMPipeline``), its prompt lookup (``prompt_lookup=True``), its
    speculative decoding with a draft model's IR (``draft_model``) or its EAGLE-3 decoding (``eagle3``: the
    directories bench/ov_eagle3.py prepares), ``k`` tokens drafted per step."""

    kind = "baseline"

    def __init__(
        self,
        name: str,
        ir_dir: str,
        threads: int,
        eos_ids: set[int],
        mode: str = "plain",
        draft_dir: str | None = None,
        k: int = 4,
    ):
        import openvino_genai as ov_genai  # ImportError means: skipped

        self.name, self.eos_ids, self.mode, self.k = name, eos_ids, mode, k
        kw = {"INFERENCE_NUM_THREADS": threads}
        if mode == "lookup":
            kw["prompt_lookup"] = True
        elif mode in ("draft", "eagle3"):
            kw["draft_model"] = ov_genai.draft_model(draft_dir, "CPU", INFERENCE_NUM_THREADS=threads)
        self.genai = ov_genai
        self.pipe = ov_genai.LLMPipeline(ir_dir, "CPU", **kw)

    def _config(self, sp: SamplingParams):
        c = self.genai.GenerationConfig()
        c.max_new_tokens = sp.max_new_tokens
        c.do_sample = not sp.greedy
        if not sp.greedy:
            c.temperature, c.top_p = sp.temperature, sp.top_p
            c.top_k = sp.top_k or 0
            c.rng_seed = sp.seed or 0
        if self.mode == "lookup":
            c.num_assistant_tokens, c.max_ngram_size = self.k, 3
        elif self.mode in ("draft", "eagle3"):
            c.num_assistant_tokens = self.k
        return c

    def run(self, ids: list[int], sp: SamplingParams) -> dict:
        import numpy as np
        import openvino as ov

        x = np.asarray([ids], np.int64)
        inputs = self.genai.TokenizedInputs(ov.Tensor(x), ov.Tensor(np.ones_like(x)))
        config = self._config(sp)
        first = FirstToken()
        t0 = time.perf_counter()
        out = self.pipe.generate(inputs, config, self._streamer(first))
        wall = time.perf_counter() - t0
        new = _until_eos([int(t) for t in out.tokens[0]], self.eos_ids)
        return {"token_ids": new, "wall_s": wall, "first_token_s": first.seconds(wall)}

    def _streamer(self, first: FirstToken):
        """An OpenVINO GenAI streamer that marks the first token (``write`` gets token ids, one or a list)."""
        genai = self.genai

        class Streamer(genai.StreamerBase):
            def write(self, token):
                first.token()
                return genai.StreamingStatus.RUNNING

            def end(self):
                pass

        return Streamer()


RUNNERS = (EngineRunner, HFRunner, LlamaCppRunner, OVGenAIRunner)  # every kind of runner the bench makes
