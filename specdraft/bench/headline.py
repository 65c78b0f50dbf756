"""``specdraft bench --preset headline`` (``make bench``): the README's results table, measured here.

One process, interleaved, greedy, after a warm-up: core18 + code_edit (27 prompts), 128 new tokens, so
that the decode phase, which speculation speeds up, outweighs the prompt's prefill. It runs the fastest
plain CPU decoder of each file and backend (llama.cpp and OpenVINO GenAI on the Q4_0 file), the stronger
speculative baseline (llama.cpp's prompt lookup), and specdraft's lossless methods on the llama.cpp and
OpenVINO backends, each backend's greedy output checked against its own plain decoding (the engine's plain
decoding on each). Speedups are over the fastest plain decoder of the run, in the decode phase and end to
end apart (docs/benchmark-log.md#the-headline-run-its-design). A NAME:VARIANT target's catalog file runs as
a plain baseline too only when asked (``--methods``): on every CPU measured the Q4_0 file decoded faster.
The preset fills only the options the user did not give (one typed at its default value counts as given):
``--target``, ``--backend``, ``--max-new-tokens``, ``--n-per-task`` and the rest still apply.
"""

from __future__ import annotations

from .report import FASTEST_PLAIN

NAME = "headline"
TARGET = "qwen2.5-coder-1.5b:Q4_0"  # `specdraft models quantize qwen2.5-coder-1.5b --type Q4_0` makes it
MAX_NEW_TOKENS = 128  # 27 prompts x 7 decoders: about 25 minutes on a 2-core AMD EPYC Zen 4 (docs/benchmark-log.md)
VARIANTS = {"suffix_k16": {"method": "suffix", "k": 16, "max_k": 16}}  # its trees pay on long matches


def headline_config(target: str) -> dict:
    """The options and variants of the preset for ``target`` (a catalog name, or NAME:VARIANT for a GGUF copy)."""
    plain = ["llama_cpp"]
    # one configuration per backend, the best measured there: auto on llama.cpp (whose steep cost curve
    # leaves it plain on most generic prompts), suffix trees on OpenVINO (whose flat curve pays for them)
    spec = ["auto", "openvino:suffix_k16"]
    return {
        "backend": "llama",
        "preset": "core18+code_edit",
        "max_new_tokens": MAX_NEW_TOKENS,
        "llama_k": "4",
        "reference": FASTEST_PLAIN,
        "out": "results/headline.json",
        "variants": VARIANTS,
        "methods": ",".join(plain + ["ov_genai", "llama_cpp_lookup"] + spec),
    }
