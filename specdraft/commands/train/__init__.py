"""``specdraft train medusa|eagle|eagle3``: train a draft head on the target's own outputs (self-distillation).

One module per head kind, chosen through ``KINDS``: medusa.py and eagle.py (data: DIR/data.pt, data.py),
eagle3.py (data made on the target that serves, appended and resumable: eagle3_data.py; the
training-time test: eagle3_ttt.py). They share the data rules (data.py: the features recorded while the
engine decodes, one draft-vocabulary rule) and the loop (loop.py: AdamW, batches seeded by (seed, step),
checkpoints every ``--checkpoint-every`` steps, ``--resume`` from the atomic train_state.pt).

Each kind declares the options it reads; one given for another kind is an error, not ignored.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields, replace
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from ...core.errors import ConfigError, SpecDraftError
from ...scale import cluster
from .loop import STATE_FILE, Run, fit


@dataclass(frozen=True)
class TrainOptions:
    """``specdraft train``'s flags."""

    kind: str  # medusa | eagle | eagle3
    target: str
    data: str | None  # prompts jsonl (eagle3: or --synth)
    output: str  # the head directory (checkpoints, data)
    steps: int = 300
    lr: float | None = None  # default: the kind's
    batch_size: int | None = None  # default: the kind's
    max_new_tokens: int = 96
    max_prompts: int | None = None
    max_prompt_tokens: int | None = None
    heads: int = 3  # medusa
    blocks: int = 1  # medusa
    draft_vocab: int | None = None  # eagle; eagle3 (default eagle3.EAGLE3_DRAFT_VOCAB)
    synth: int | None = None  # eagle3: prompts the target writes itself (Magpie)
    synth_max_tokens: int = 96
    gen_backend: str = "auto"  # eagle3: the backend that makes the data (auto: llama.cpp where it can)
    gen_batch: int = 16
    ttt_steps: int = 5  # eagle3: draft steps of the training-time test
    intermediate_size: int | None = None  # eagle3: the head's MLP width (default eagle3.EAGLE3_INTERMEDIATE)
    max_len: int = 768  # eagle3: tokens of a sequence trained on (prompt + answer, cut)
    device: str = "auto"  # eagle3: where the head trains (auto: cuda when there is one)
    storage: str = "bfloat16"  # eagle3: the head file's weights (bfloat16, float32, or our compact int8)
    holdout: int = 50  # eagle3: prompt i with i % holdout == 0 is kept out of training (a held-out split; 0: none)
    data_only: bool = False  # eagle3: make the data, do not train
    train_only: bool = False  # eagle3: train on DIR/data as it is, make none
    checkpoint_every: int = 50
    resume: bool = False
    no_chat: bool = False
    threads: int | None = None
    seed: int = 0
    ray: str | None = None
    ray_workers: int | None = None
    ray_worker_cpus: int | None = None
    command: str | None = None  # recorded in the head's config (default: this process's command line)

    def ray_options(self) -> cluster.RayOptions:
        return cluster.RayOptions(self.ray, self.ray_workers, self.ray_worker_cpus, self.threads)


@dataclass(frozen=True)
class Kind:
    """A head kind: its module's entry point, defaults, and the options only it reads."""

    main: Callable  # (opts, resume: bool, ray_builder) -> exit code
    batch_size: int
    lr: float
    own: tuple[str, ...]  # TrainOptions fields only this kind reads (beside COMMON)
    check: Callable | None = None


RAY = ("ray", "ray_workers", "ray_worker_cpus")
EAGLE3_OWN = (
    "draft_vocab",
    "synth",
    "synth_max_tokens",
    "gen_backend",
    "gen_batch",
    "ttt_steps",
    "intermediate_size",
    "max_len",
    "device",
    "storage",
    "holdout",
    "data_only",
    "train_only",
    *RAY,
)


def _kinds() -> dict[str, Kind]:
    from . import eagle, eagle3, medusa

    return {
        "medusa": Kind(partial(_heads_main, setup=medusa.setup), 256, 1e-3, ("heads", "blocks", *RAY)),
        "eagle": Kind(partial(_heads_main, setup=eagle.setup), 4, 1e-3, ("draft_vocab", *RAY)),
        "eagle3": Kind(eagle3.main, 2, 3e-4, EAGLE3_OWN, check=eagle3.check),
    }


KIND_NAMES = ("medusa", "eagle", "eagle3")


def add_parser(sub):
    t = sub.add_parser(
        "train", help="train a Medusa, EAGLE or EAGLE-3 head on the target's own answers (self-distillation)"
    )
    t.add_argument("kind", choices=KIND_NAMES, help="which head to train")
    t.add_argument("--target", required=True, help="the target model (name, NAME:VARIANT, directory or .gguf)")
    t.add_argument(
        "--data", default=None, help="prompts jsonl (turns / prompt / text field per line); eagle3: or --synth"
    )
    t.add_argument("-o", "--output", required=True, help="head directory (checkpoints, data)")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--lr", type=float, default=None, help="default 1e-3 (medusa, eagle), 3e-4 (eagle3)")
    t.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="positions per step (medusa, default 256) or sequences per step (eagle 4, eagle3 2)",
    )
    t.add_argument("--max-new-tokens", type=int, default=96, help="tokens the target answers per prompt")
    t.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts")
    t.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="skip prompts longer than N tokens (long prompts cost most of the data time)",
    )
    t.add_argument("--heads", type=int, default=3, help="medusa: number of heads (K)")
    t.add_argument("--blocks", type=int, default=1, help="medusa: residual blocks per head")
    t.add_argument(
        "--draft-vocab", type=int, default=None, help="eagle, eagle3: draft over the N most frequent answer tokens only"
    )
    _add_eagle3_args(t)
    t.add_argument("--checkpoint-every", type=int, default=50)
    t.add_argument("--resume", action="store_true", help="continue from the checkpoint in -o DIR")
    t.add_argument("--no-chat", action="store_true", help="feed raw prompts instead of the chat template")
    t.add_argument("--threads", type=int, default=None)
    t.add_argument("--seed", type=int, default=0)
    cluster.add_ray_args(
        t,
        "medusa, eagle: generate the training data on Ray worker actors, prompts sharded over "
        "them in batches, each worker loading the target once; the data is gathered here and saved as "
        "usual, and training runs here. No value: a local Ray instance; else a cluster address (auto, "
        "HOST:PORT); write --ray=ADDRESS, or --ray after KIND",
    )
    t.set_defaults(command=None)
    return t


def _add_eagle3_args(t) -> None:
    t.add_argument(
        "--synth",
        type=int,
        default=None,
        metavar="N",
        help="eagle3: N prompts written by the target itself (Magpie: its chat template's user prefix, "
        "under a few generic system prompts, at mixed temperatures), seeded by --seed; kept in "
        "-o DIR/data/ and extended on the next run",
    )
    t.add_argument("--synth-max-tokens", type=int, default=96, help="eagle3: longest synthesized prompt")
    t.add_argument(
        "--gen-backend",
        choices=["auto", "llama", "hf", "openvino"],
        default="auto",
        help="eagle3: the backend that writes prompts and answers, many rows per forward, and hands over "
        "the layers' outputs in the same forwards (auto: llama.cpp where the target has a GGUF file)",
    )
    t.add_argument("--gen-batch", type=int, default=16, help="eagle3: sequences decoded together")
    t.add_argument("--ttt-steps", type=int, default=5, help="eagle3: draft steps of the training-time test")
    t.add_argument("--intermediate-size", type=int, default=None, help="eagle3: the head's MLP width")
    t.add_argument("--max-len", type=int, default=768, help="eagle3: tokens per training sequence (cut)")
    t.add_argument("--device", default="auto", help="eagle3: cpu, cuda, cuda:N or auto")
    t.add_argument(
        "--storage",
        choices=["bfloat16", "float32", "int8"],
        default="bfloat16",
        help="eagle3: the head file's weights (int8: specdraft's compact rows; `specdraft heads export` "
        "writes the others' dtype)",
    )
    t.add_argument(
        "--holdout",
        type=int,
        default=50,
        metavar="N",
        help="eagle3: prompt i with i %% N == 0 is kept out of training, for measuring the head on prompts "
        "of its own kind that it never saw (0: train on all)",
    )
    t.add_argument("--data-only", action="store_true", help="eagle3: make (or extend) the data, do not train")
    t.add_argument(
        "--train-only",
        action="store_true",
        help="eagle3: train on -o DIR/data as it is (made by an earlier or a running --data-only job)",
    )


def _foreign_option(opts: TrainOptions, kinds: dict[str, Kind]) -> str | None:
    """An option set (away from its default) that only other kinds read."""
    defaults = {f.name: f.default for f in fields(TrainOptions)}
    mine = set(kinds[opts.kind].own)
    for name in sorted({n for k in kinds.values() for n in k.own} - mine):
        if getattr(opts, name) != defaults[name]:
            users = [k for k, v in kinds.items() if name in v.own]
            return f"--{name.replace('_', '-')} is for train {' and '.join(users)} only, not {opts.kind}"
    return None


def check_options(opts: TrainOptions) -> TrainOptions:
    """The options checked (and the kind's defaults filled) before anything loads."""
    kinds = _kinds()
    kind = kinds[opts.kind]
    problem = _foreign_option(opts, kinds)
    if problem:
        raise ConfigError(problem)
    opts = replace(opts, batch_size=opts.batch_size or kind.batch_size, lr=opts.lr or kind.lr)
    if opts.draft_vocab is not None and opts.draft_vocab < 1:
        raise ConfigError("--draft-vocab N needs N >= 1")
    if kind.check is not None:
        kind.check(opts)
    elif opts.data is None:
        raise ConfigError(f"train {opts.kind} needs --data PROMPTS.jsonl")
    opts.ray_options().check()
    for name in ("steps", "batch_size", "checkpoint_every", "heads", "max_prompt_tokens"):
        v = getattr(opts, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if opts.data is not None and not Path(opts.data).exists():
        raise SpecDraftError(f"--data {opts.data} not found")
    if opts.resume:
        _check_resume(opts)
    return opts


def _check_resume(opts: TrainOptions) -> None:
    from ...models.heads import read_head_config

    out = Path(opts.output)
    if not (out / STATE_FILE).exists():
        raise SpecDraftError(f"--resume: no checkpoint in {out} (need config.json and {STATE_FILE})")
    saved = read_head_config(out)
    if saved["type"] != opts.kind:
        raise ConfigError(f"--resume: {out} holds a {saved['type']} head, not {opts.kind}")
    trained_for = (saved.get("specdraft") or {}).get("target") if opts.kind == "eagle3" else saved.get("target")
    if trained_for != opts.target:
        raise ConfigError(f"--resume: {out} was trained for target {trained_for!r}, not {opts.target!r}")


def train_main(opts: TrainOptions, ray_builder=None) -> int:
    """``ray_builder``: what --ray runs on Ray workers (bench/shard.py's RAY_BUILDERS, which the CLI passes: the
    bench package sits above this module): ``.heads(ray options, target)``, data.build_data's stand-in, and
    ``.eagle3(ray options, opts)``, EAGLE-3's answer stage."""
    opts = check_options(opts)
    return _kinds()[opts.kind].main(opts, opts.resume, ray_builder)


def _heads_main(opts: TrainOptions, resume: bool, ray_builder, setup) -> int:
    """Medusa and EAGLE: DIR/data.pt on the transformers target (float32: the heads read its final norm);
    ``setup(target, seqs, saved config, opts)`` -> (head, loss) is the kind's."""
    from ...api import SpecDecoder
    from ...models.heads import read_head_config, save_head, target_signature
    from .data import build_data, load_or_build_data

    if opts.ray is not None and ray_builder is None:
        raise ConfigError("--ray needs the Ray builders: train_main(opts, specdraft.bench.shard.RAY_BUILDERS)")
    out = Path(opts.output)
    torch.manual_seed(opts.seed)
    dec = SpecDecoder.load(opts.target, dtype="float32", threads=opts.threads, backend="hf", device="cpu")
    target = dec.target
    build = ray_builder.heads(opts.ray_options(), opts.target) if opts.ray is not None else build_data
    seqs, data_meta = load_or_build_data(
        dec,
        out,
        opts.data,
        opts.target,
        opts.max_new_tokens,
        not opts.no_chat,
        opts.max_prompts,
        opts.max_prompt_tokens,
        build,
    )
    saved = read_head_config(out) if resume else None
    head, loss = setup(target, seqs, saved, opts)
    command = "specdraft " + " ".join(sys.argv[1:]) if opts.command is None else opts.command
    extra = {
        "target": opts.target,
        "target_signature": target_signature(target),
        "data": str(opts.data),
        "data_meta": data_meta,
        "command": command,
        "lr": opts.lr,
        "batch_size": opts.batch_size,
        "seed": opts.seed,
    }
    run = Run(
        head,
        loss,
        save_head,
        out,
        opts.steps,
        opts.lr,
        opts.seed,
        opts.checkpoint_every,
        opts.kind,
        vocab_size=target.vocab_size,
    )
    return fit(run, resume, extra)
