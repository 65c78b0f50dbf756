"""``specdraft train eagle3``: data made on the target that serves (eagle3_data.py), then the
training-time test (eagle3_ttt.py); the head is written in the reference layout (models/head_formats.py).

DIR/data/meta.json records what the data was made with (target, backend, layers, answer length, chat,
prompt source and seed); a run with other settings is refused, since it would mix data. The head's
MLP width defaults to EAGLE3_INTERMEDIATE and its draft vocabulary to EAGLE3_DRAFT_VOCAB (smaller than
the target's own 8960 and 151936 for Qwen2.5 1.5B: on a CPU a draft token must cost a few percent of a
target forward, and a small head learns faster from the data a CPU can make).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ...core.device import torch_device
from ...core.errors import ConfigError, SpecDraftError
from ...core.jsonl import AppendedJsonl, read_json_file
from ...models.eagle3 import Eagle3Head, Eagle3Shape, eagle3_layers, ttt_batch, ttt_loss
from ...models.heads import target_signature
from ...models.llama_probe import native_bf16
from . import eagle3_data as d3
from .data import draft_vocab
from .eagle3_ttt import Eagle3Data
from .loop import Run, fit

EAGLE3_INTERMEDIATE = 2048
EAGLE3_DRAFT_VOCAB = 12288


def check(opts) -> None:
    if opts.train_only:
        if opts.data is not None or opts.synth is not None or opts.data_only or opts.ray is not None:
            raise ConfigError(
                "--train-only trains on -o DIR/data as it is; --data, --synth, --data-only and --ray make data"
            )
    elif (opts.data is None) == (opts.synth is None):
        raise ConfigError("train eagle3 needs exactly one of --data PROMPTS.jsonl and --synth N (or --train-only)")
    for name in ("synth", "gen_batch", "ttt_steps", "max_len", "synth_max_tokens", "intermediate_size"):
        v = getattr(opts, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if opts.holdout < 0:
        raise ConfigError(f"--holdout must be >= 0, got {opts.holdout}")
    if opts.max_len < opts.ttt_steps + 2:
        raise ConfigError(f"--max-len {opts.max_len} leaves no room for {opts.ttt_steps} draft steps")
    torch_device(opts.device)


def generation_model(opts):
    """The target that writes prompts and answers and hands over its layers: --gen-backend (auto:
    llama.cpp where the target has a GGUF file and llama.cpp hands over layers, else transformers)."""
    from ...models.backends import load_model

    if opts.gen_backend != "auto":  # (the data is made on the CPU; the head trains on --device)
        return load_model(opts.target, "float32", backend=opts.gen_backend, device="cpu")
    try:
        m = load_model(opts.target, "float32", backend="llama", device="cpu")
        if m.capabilities.layers:
            return m
    except (SpecDraftError, ImportError, OSError) as e:
        print(f"eagle3: data on transformers ({str(e).splitlines()[0]})", file=sys.stderr)
    return load_model(opts.target, "float32", backend="hf", device="cpu")


def data_meta(opts, layers, gen, out: Path) -> dict:
    """What DIR/data was made with (module doc)."""
    want = {
        "target": opts.target,
        "backend": gen.backend,
        "layers": list(layers),
        "max_new_tokens": opts.max_new_tokens,
        "chat": not opts.no_chat,
        "prompts": str(opts.data) if opts.data else "synth",
        "max_prompt_tokens": opts.max_prompt_tokens,
    }
    if opts.synth:
        want.update(seed=opts.seed, synth_max_tokens=opts.synth_max_tokens)
    f = out / "data" / "meta.json"
    if f.exists():
        try:
            have = read_json_file(f)
            if not isinstance(have, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            raise SpecDraftError(f"{f}: {e}; use another -o DIR") from None
        if have != want:
            diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
            raise ConfigError(
                f"{out}/data was made with other settings ({', '.join(diff)}: "
                f"{[have.get(k) for k in diff]}); use another -o DIR or the same settings"
            )
    else:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(want, indent=1))
    return want


SYNTH_ROUND = 256  # synthesized prompts answered before the next ones are written (data grows in rounds)


def make_data(opts, gen, layers, out: Path, answer=None) -> dict:
    """Prompts, answers and features, each stage continuing what DIR/data holds; with --synth in rounds of
    SYNTH_ROUND prompts, each answered before the next round is written, so the data usable for training
    grows from the start; ``answer``: stage 2 (d3.answer_with_features; with --ray, answers made on Ray workers,
    their features then added by stage 3's prefill); -> the data's meta."""
    from ...core.prompts import load_prompts

    meta = data_meta(opts, layers, gen, out)
    data = out / "data"
    made = {"tokens": 0, "seconds": 0.0}
    rounds = range(SYNTH_ROUND, opts.synth + SYNTH_ROUND, SYNTH_ROUND) if opts.synth else [None]
    for want in rounds:
        if opts.synth:
            prompts = d3.synth_prompts(
                gen, gen.tokenizer, min(want, opts.synth), data, opts.gen_batch, opts.synth_max_tokens, opts.seed
            )
        else:
            prompts = [r["prompt"] for r in load_prompts(opts.data)][: opts.max_prompts or None]
        r = (answer or d3.answer_with_features)(
            gen, encode_all(gen, prompts, opts), data, layers, opts.gen_batch, opts.max_new_tokens, opts.seed
        )
        made = {k: made[k] + r[k] for k in made}
    answers = [r for r in AppendedJsonl(data / "answers.jsonl", d3.ANSWER_FIELDS).rows if r["i"] < len(prompts)]
    d3.prefill_features(gen, answers, data, layers, opts.gen_batch)  # answers imported without features
    return {
        **meta,
        "n_prompts": len(prompts),
        "n_seqs": len(answers),
        "answer_tokens": sum(len(a["tokens"]) - a["n_prompt"] for a in answers),
        "made": made,
    }


def existing_data(opts, layers, out: Path) -> dict:
    """--train-only: DIR/data's meta, checked to be this target's and these layers' (another job may still
    be appending to the data; training reads what is there when it starts)."""
    f = out / "data" / "meta.json"
    try:
        meta = read_json_file(f)
    except ValueError as e:
        raise SpecDraftError(
            f"--train-only: {f}: {e} (make the data first: --synth N or --data PROMPTS.jsonl)"
        ) from None
    if not isinstance(meta, dict) or meta.get("target") != opts.target or meta.get("layers") != list(layers):
        raise ConfigError(
            f"--train-only: {out}/data was made for target {meta.get('target')!r}, layers "
            f"{meta.get('layers')}; this run is for {opts.target!r}, layers {list(layers)}"
        )
    return meta


def encode_all(gen, prompts: list[str], opts) -> list[tuple[int, list[int]]]:
    """(index, token ids) of the prompts that fit the context with their answer (and --max-prompt-tokens)."""
    out = []
    for i, p in enumerate(prompts):
        ids = encode(gen.tokenizer, p, chat=not opts.no_chat)
        if len(ids) + opts.max_new_tokens <= gen.max_context and len(ids) <= (opts.max_prompt_tokens or len(ids)):
            out.append((i, ids))
    return out


def encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(prompt, add_special_tokens=False)["input_ids"]]


def resumed_shape(out: Path, gen) -> Eagle3Shape:
    from ...models.head_formats import read
    from ...models.heads import read_head_config

    return read(out, read_head_config(out, expect_type="eagle3"), gen.facts.num_layers).shape


def new_head(gen, data: Eagle3Data, layers, opts) -> Eagle3Head:
    """A head for the target: its draft vocabulary the most frequent answer tokens, its LM head starting as
    the target's rows of them; its final norm starts at 1 (the target's scale on the untrained layer's
    output made the first losses 1.6x higher on SmolLM2)."""
    ids, covered = draft_vocab(data.tokens, data.n_prompt, opts.draft_vocab or EAGLE3_DRAFT_VOCAB, gen.vocab_size)
    print(
        f"eagle3: draft vocabulary of {ids.numel()} tokens covers {covered:.1%} of the answer tokens", file=sys.stderr
    )
    shape = Eagle3Shape.for_target(gen.facts, layers, ids.numel(), opts.intermediate_size or EAGLE3_INTERMEDIATE)
    head = Eagle3Head(shape)
    head.set_draft_ids(ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(gen.output_rows(ids).float())
    return head


def saver(gen, opts):
    """The head directory of a checkpoint: the reference layout (+ its specdraft section)."""
    from ...models.head_formats import write

    sig = target_signature(gen)
    dtype = torch.bfloat16 if opts.storage == "bfloat16" else torch.float32

    def save(head, out: Path, extra: dict) -> None:
        meta = {"type": "eagle3", "target": opts.target, "target_signature": sig, **extra}
        write(out, head.shape, head.state_dict(), meta, dtype=dtype, int8=opts.storage == "int8")

    return save


def main(opts, resume: bool, ray_builder=None) -> int:
    from ...models.loading import set_threads

    out = Path(opts.output)
    torch.manual_seed(opts.seed)
    set_threads(opts.threads)  # llama.cpp's threads follow torch's
    gen = generation_model(opts)
    shape = resumed_shape(out, gen) if resume else None
    layers = shape.layers if shape is not None else eagle3_layers(gen.num_layers)
    if opts.ray is not None and ray_builder is None:
        raise ConfigError("--ray needs the Ray builders: train_main(opts, specdraft.bench.shard.RAY_BUILDERS)")
    answer = ray_builder.eagle3(opts.ray_options(), opts) if opts.ray is not None else None
    meta = existing_data(opts, layers, out) if opts.train_only else make_data(opts, gen, layers, out, answer)
    print(
        f"eagle3 data: {meta.get('n_seqs', '?')} sequences, {meta.get('answer_tokens', '?')} answer tokens",
        file=sys.stderr,
    )
    if opts.data_only:
        print(json.dumps({"data": str(out / "data"), **meta}))
        return 0
    data = Eagle3Data(out / "data", len(layers) * gen.facts.hidden_size, opts.holdout)
    head = Eagle3Head(shape) if shape is not None else new_head(gen, data, layers, opts)
    device = torch_device(opts.device)
    bf16 = device.type == "cuda" or native_bf16()
    print(
        f"eagle3: layers {list(head.layers)}, {head.parameter_count() / 1e6:.1f}M parameters, draft vocabulary "
        f"{head.shape.draft_vocab_size}, {len(data)} sequences ({data.answer_tokens} answer tokens), "
        f"{opts.ttt_steps} draft steps, on {device}{' in bf16' if bf16 else ''}",
        file=sys.stderr,
    )
    head = head.to(device)
    t2d_index = torch.full((gen.vocab_size,), -100, dtype=torch.long)

    def loss(g):
        if not loss.ready:  # a resumed head's draft ids arrive with its weights, after setup
            t2d_index[head.draft_ids.cpu()] = torch.arange(head.shape.draft_vocab_size)
            loss.ready = True
        idx = torch.randint(0, len(data), (opts.batch_size,), generator=g).tolist()
        F, toks, labels = ttt_batch(data, idx, t2d_index, opts.ttt_steps, opts.max_len)
        total, accs = ttt_loss(head, lambda ids: gen.embed(ids).float(), F, toks, labels, device, bf16)
        loss.postfix = {"acc": "/".join(f"{a:.2f}" for a in accs)}
        return total

    loss.ready = False
    command = "specdraft " + " ".join(sys.argv[1:]) if opts.command is None else opts.command
    extra = {"data_meta": meta, "command": command, "lr": opts.lr, "batch_size": opts.batch_size, "seed": opts.seed}
    run = Run(
        head,
        loss,
        saver(gen, opts),
        out,
        opts.steps,
        opts.lr,
        opts.seed,
        opts.checkpoint_every,
        "eagle3",
        clip=0.5,
        vocab_size=gen.vocab_size,
    )  # EAGLE's clipping: early steps on large features spike
    return fit(run, resume, extra)
