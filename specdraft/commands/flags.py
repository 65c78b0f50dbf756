"""The command-line flags several commands share: the models to load (``add_model_args``), the backend,
the speculation (``add_spec_args``) and the sampling (``add_sampling_args``). Each command adds its own
subcommand parser in its own module (``add_parser(subparsers)``) with these; cli.py turns the parsed
flags into typed settings (api.ModelSettings, SpecConfig, SamplingParams, a command's settings)."""

from __future__ import annotations

import argparse

from ..core import methods
from ..core.config import LOSSY_RULES
from ..core.errors import SpecDraftError

DTYPES = ["float32", "bfloat16", "float16"]


def add_model_args(p: argparse.ArgumentParser, default_target="qwen2.5-coder-1.5b", default_draft=None):
    """The flags of api.ModelSettings (and --quantize, which the CLI folds into --target)."""
    p.add_argument("--target", default=default_target, help="model name, transformers directory or .gguf file")
    p.add_argument("--draft", default=default_draft, help="draft model (needed by --method draft_model)")
    p.add_argument("--draft-layers", type=int, default=None, help="keep only the first N layers of the draft")
    p.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="weights dtype on the hf backend (default bfloat16; a GGUF file carries its own on the llama "
        "backend, so with no --backend named, --dtype means hf)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch / llama.cpp threads (default: all cores)")
    p.add_argument(
        "--quantize",
        default=None,
        metavar="int8|int4[-gN]",
        help="hf backend: weight-only int8 / int4 linear layers for the target (a different model: "
        "compare it with its own plain decoding); same as --target NAME:int4. A draft takes the "
        "suffix too, and --draft self:int4 is the target's own weights in int4",
    )
    add_backend_arg(p)
    add_draft_backend_arg(p)
    add_device_args(p)


def add_device_args(p: argparse.ArgumentParser, draft: bool = True):
    """--device (and --draft-device): where the models run (core/device.py; checked before anything loads)."""
    p.add_argument(
        "--device",
        default="auto",
        metavar="auto|cpu|cuda|cuda:N|gpu",
        help="where the target runs: auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N "
        "(transformers; llama.cpp offloads every layer with a CUDA build of llama-cpp-python), gpu "
        "(OpenVINO's Intel GPU device). Default auto",
    )
    if draft:
        p.add_argument(
            "--draft-device", default=None, metavar="DEVICE", help="where the draft model runs (default: --device's)"
        )


def add_draft_backend_arg(p: argparse.ArgumentParser):
    from ..models.backends import BACKENDS

    p.add_argument(
        "--draft-backend",
        default=None,
        choices=tuple(BACKENDS),
        help="the draft model's backend (default: --backend's); e.g. llama: a small GGUF draft on "
        "llama.cpp for a transformers target (any tokenizer; lossless either way)",
    )


def add_backend_arg(p: argparse.ArgumentParser, default: str | None = None):
    from ..models.backends import BACKENDS

    p.add_argument(
        "--backend",
        default=default,
        choices=tuple(BACKENDS) + ("auto",),
        help="; ".join(f"{b.name}: {b.summary}" for b in BACKENDS.values())
        + "; auto: the backend and weights measured fastest for --target on this CPU (`specdraft autotune "
        "--paths`, else `specdraft doctor`'s curves, else measured once now). Default: "
        + (default or "auto for a catalog model, else hf"),
    )


def help_text() -> str:
    """One line per method for --method's help."""
    return "; ".join(
        f"{m.name}: {m.summary}" + (f" [needs a {m.needs.replace('_', ' ')}]" if m.needs else "")
        for m in methods.REGISTRY.values()
    )


def method_name(name: str) -> str:
    """--method is checked by the registry: an unknown name is the one-line ``error: unknown method ...``
    (a SpecDraftError, which is no ValueError, so argparse lets it through to main)."""
    try:
        return methods.method(name).name
    except SpecDraftError as e:
        raise SpecDraftError(str(e)) from None


def add_spec_args(p: argparse.ArgumentParser):
    """The flags cli.spec_from_args turns into a SpecConfig."""
    p.add_argument(
        "--method",
        default=None,
        type=method_name,
        choices=tuple(methods.REGISTRY),
        metavar="METHOD",
        help=f"default auto (it picks per request and step among those this setup can run); one of: {help_text()}",
    )
    p.add_argument("--k", type=int, default=None, help="draft tokens per step")
    p.add_argument(
        "--schedule",
        default=None,
        choices=methods.SCHEDULES,
        help="draft length per step (default constant k; cost_aware measures when speculation pays)",
    )
    trees = [m.name for m in methods.REGISTRY.values() if len(m.trees) > 1]
    p.add_argument(
        "--tree",
        default=None,
        choices=methods.ALL_TREES,
        help=f"{' / '.join(trees)}: a chain (default) or a token tree (static, dynamic; see each method); "
        "shape fields via --config (tree_branching, tree_choices, tree_budget, tree_topk)",
    )
    p.add_argument("--skip-config", default=None, help="layer_skip: the JSON written by `specdraft tune-skip`")
    p.add_argument("--exit-layer", type=int, default=None, help="early_exit: draft with the target's first N layers")
    p.add_argument("--datastore", default=None, help="suffix method: a store from `specdraft datastore build`")
    p.add_argument(
        "--head",
        default=None,
        help="medusa / eagle / eagle3 (and auto's EAGLE-3 arms): a head directory from `specdraft train` "
        "(eagle3: or an EAGLE-3 checkpoint of SpecForge, vLLM or speculators)",
    )
    p.add_argument(
        "--lossy",
        default=None,
        choices=LOSSY_RULES,
        help="opt into a LOSSY verification rule when sampling: typical = Medusa's typical acceptance "
        "(typical_epsilon / typical_delta via --config); the output is no longer the target's "
        "distribution",
    )
    p.add_argument("--config", default=None, help="SpecConfig as a JSON file (CLI flags override it)")


def add_sampling_args(p: argparse.ArgumentParser):
    """The flags cli.sampling_from_args turns into SamplingParams."""
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens less than MIN_P times as likely as the top one"
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages tokens of prompt + output")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    p.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (in [-100, 100]) to token ID's logit (repeatable)",
    )
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS before this many new tokens")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="report each token's log-probability and the N most likely alternatives (--json)",
    )
    c = p.add_mutually_exclusive_group()
    c.add_argument("--json-schema", default=None, metavar="FILE", help="constrain the output to this JSON schema")
    c.add_argument("--regex", default=None, help="constrain the output to match this regular expression")
    c.add_argument("--grammar", default=None, metavar="FILE", help="constrain the output to this Lark grammar")
