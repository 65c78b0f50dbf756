"""``specdraft train medusa|eagle|eagle3``: train a draft head on the target's own outputs (self-distillation).

1. Data (cached in DIR/data.pt, reused by later runs and by ``--resume``): the target answers each
   prompt greedily itself (transformers ``generate``, batched; chat template unless ``--no-chat``);
   one forward over prompt + answer gives its features (final-norm outputs) at every position. Those
   features and tokens are the training data, so the head learns what this target would say.
   ``--ray [ADDRESS]`` answers the same batches on Ray worker actors (bench/shard.py's data_builder).
2. Training (CPU, AdamW, only the head's weights; the target's embedding and LM head are frozen):
   - medusa: head i at position t is trained with cross-entropy to the token at t + i + 2, on the
     positions of the answer (t >= n_prompt - 1);
   - eagle: on whole sequences, fc(f_t, embed(x_{t+1})) -> decoder layer -> f_hat_{t+1}; loss =
     smooth-L1(f_hat_{t+1}, f_{t+1}) + 0.1 x cross-entropy(LM head(f_hat_{t+1}), x_{t+2}) (EAGLE's
     weighting), the cross-entropy on answer positions; with ``--draft-vocab N`` over the N most
     frequent tokens of the data only (tokens outside them are left out of the cross-entropy).
3. Checkpoints every ``--checkpoint-every`` steps and at the end: DIR/head.safetensors +
   DIR/config.json (head type, target, dimensions, target fingerprint, step, losses, the command
   and data path) + DIR/train_state.pt (optimizer state, step). ``--resume`` continues from there.
   Batches are drawn from a generator seeded by (seed, step), so a resumed run sees the same
   batches as an uninterrupted one.

eagle3 (EAGLE-3) has data of its own, under DIR/data, each stage appended batch by batch and
continued by the next run (``--data-only`` stops after them):
   a. prompts from --data, or written by the target itself (``--synth N``: Magpie, the chat
      template's user prefix fed alone, sampled with seeds, deduplicated);
   b. the target's greedy answers, many rows per forward on ``--gen-backend`` (llama.cpp by default);
   c. the three layers' outputs (heads.eagle3_layers) of every position, one transformers forward per
      sequence, stored bf16 and memory-mapped for training;
   d. the training-time test (``ttt_loss``): K draft steps per anchor, step j feeding the head's own
      output of step j - 1, cross-entropy to the target's token j + 2 ahead weighted 0.8^j; AdamW,
      clipped at 0.5, on ``--device`` (cuda when there is one). The head is shipped in int8; the
      float32 weights for ``--resume`` live in train_state.pt.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ..scale import cluster
from ..core.errors import ConfigError, SpecDraftError
from ..models.heads import (
    EagleHead,
    MedusaHeads,
    read_head_config,
    save_head,
    target_signature,
)

DATA_FILE = "data.pt"
STATE_FILE = "train_state.pt"


class _NoBar:  # pragma: no cover - without tqdm
    def update(self, n=1): ...
    def set_postfix(self, **kw): ...
    def close(self): ...


def _tqdm(it=None, **kw):
    try:
        from tqdm import tqdm

        return tqdm(it, file=sys.stderr, **kw)
    except ImportError:  # pragma: no cover
        return it if it is not None else _NoBar()


# --- data --------------------------------------------------------------------------------------
DATA_BATCH = 16  # prompts per generate call of the training data (a local run and each Ray job alike)


def encode_prompts(dec, prompts: list[str], max_new_tokens: int, chat: bool,
                   max_prompt_tokens: int | None = None) -> list[list[int]]:
    """The prompts' token ids that fit the target's context (and ``max_prompt_tokens``), shortest first."""
    target = dec.target
    encoded = [dec.encode(p, chat=chat) for p in prompts]
    encoded = [ids for ids in encoded if len(ids) + max_new_tokens <= target.max_context
               and (max_prompt_tokens is None or len(ids) <= max_prompt_tokens)]
    encoded.sort(key=len)
    return encoded


def answer_batch(dec, chunk: list[list[int]], max_new_tokens: int) -> list[dict]:
    """One batch of encoded prompts: the target's greedy answers (left-padded ``generate``), then one
    forward per prompt + answer for its features."""
    model = dec.target.model
    eos = dec.target.eos_token_ids()
    pad = next(iter(sorted(eos)), 0) if eos else 0
    L = max(len(c) for c in chunk)
    ids = torch.full((len(chunk), L), pad, dtype=torch.long)
    mask = torch.zeros((len(chunk), L), dtype=torch.long)
    for j, c in enumerate(chunk):
        ids[j, L - len(c):] = torch.tensor(c)
        mask[j, L - len(c):] = 1
    with torch.inference_mode():
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad, eos_token_id=sorted(eos) or None)
    seqs = []
    for j, c in enumerate(chunk):
        ans = gen[j, L:].tolist()
        cut = next((n + 1 for n, t in enumerate(ans) if t in eos), len(ans))
        toks = torch.tensor(c + ans[:cut], dtype=torch.long)
        with torch.inference_mode():
            feats = model.model(input_ids=toks[None]).last_hidden_state[0]
        seqs.append({"tokens": toks, "hidden": feats.to(torch.float16), "n_prompt": len(c)})
    return seqs


def build_data(dec, prompts: list[str], max_new_tokens: int, chat: bool, batch: int | None = None,
               max_prompt_tokens: int | None = None) -> list[dict]:
    """The target's greedy answers and its features at every position of prompt + answer.

    Answers come from transformers' ``generate`` (greedy) on batches of left-padded prompts of
    similar length (sorted by length, so little compute goes to padding; batching is about 2x faster
    than one prompt at a time on a CPU; padding can flip a near-tie, which is harmless for training
    data); an answer ends after the first EOS. Prompts longer than ``max_prompt_tokens`` are skipped.
    Then one forward per sequence gives the features (final-norm outputs) at every position.
    ``train --ray`` answers the same batches on Ray workers (bench/shard.py's data_builder)."""
    batch = batch or DATA_BATCH
    encoded = encode_prompts(dec, prompts, max_new_tokens, chat, max_prompt_tokens)
    seqs = []
    bar = _tqdm(total=len(encoded), desc="target answers", unit="prompt")
    for i in range(0, len(encoded), batch):
        seqs += answer_batch(dec, encoded[i: i + batch], max_new_tokens)
        if hasattr(bar, "update"):
            bar.update(len(encoded[i: i + batch]))
    if hasattr(bar, "close"):
        bar.close()
    return seqs


def load_or_build_data(dec, out: Path, data_path: str, target_name: str, max_new_tokens: int, chat: bool,
                       max_prompts: int | None, max_prompt_tokens: int | None = None,
                       build=build_data) -> tuple[list[dict], dict]:
    """The cached data if it was made with these settings, else ``build``'s (build_data, or on Ray
    bench/shard.py's data_builder's), saved in DIR/data.pt."""
    f = out / DATA_FILE
    want = {"target": target_name, "data": str(data_path), "max_new_tokens": max_new_tokens, "chat": chat,
            "max_prompts": max_prompts}
    if max_prompt_tokens is not None:  # only when set, so data cached before this option still matches
        want["max_prompt_tokens"] = max_prompt_tokens
    if f.exists():
        blob = torch.load(f, weights_only=False)
        if blob.get("meta") == want:
            print(f"reusing cached training data {f} ({len(blob['seqs'])} sequences)", file=sys.stderr)
            return blob["seqs"], blob["meta"]
        print(f"cached data {f} was made with {blob.get('meta')}; regenerating for {want}", file=sys.stderr)
    from ..core.prompts import load_prompts

    rows = load_prompts(data_path)
    if max_prompts:
        rows = rows[:max_prompts]
    if not rows:
        raise SpecDraftError(f"{data_path} holds no prompts")
    t0 = time.perf_counter()
    seqs = build(dec, [r["prompt"] for r in rows], max_new_tokens, chat, max_prompt_tokens=max_prompt_tokens)
    if not seqs:
        raise SpecDraftError(f"no prompt of {data_path} fits the target's context with {max_new_tokens} new tokens"
                             + (f" and --max-prompt-tokens {max_prompt_tokens}" if max_prompt_tokens else ""))
    meta = {**want, "n_seqs": len(seqs), "n_tokens": int(sum(s["tokens"].numel() for s in seqs)),
            "build_s": round(time.perf_counter() - t0, 1)}
    out.mkdir(parents=True, exist_ok=True)
    print(f"training data: {meta['n_seqs']} sequences, {meta['n_tokens']} tokens, built in {meta['build_s']} s",
          file=sys.stderr)
    torch.save({"meta": want, "seqs": seqs, "stats": meta}, out / (DATA_FILE + ".tmp"))
    (out / (DATA_FILE + ".tmp")).replace(f)
    return seqs, want


# --- batches -----------------------------------------------------------------------------------
def medusa_examples(seqs: list[dict], n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Answer positions: features [N, H] and targets [N, K] (token t + i + 2, -100 past the end)."""
    feats, tgts = [], []
    for s in seqs:
        T, n0 = s["tokens"].numel(), s["n_prompt"]
        t = torch.arange(max(n0 - 1, 0), T - 2)
        if t.numel() == 0:
            continue
        off = t[:, None] + 2 + torch.arange(n_heads)[None]
        y = torch.where(off < T, s["tokens"][off.clamp(max=T - 1)], torch.full_like(off, -100))
        feats.append(s["hidden"][t].float())
        tgts.append(y)
    if not feats:
        raise SpecDraftError("the training data has no answer positions to train on")
    return torch.cat(feats), torch.cat(tgts)


def eagle_batch(seqs: list[dict], idx: list[int], vocab_map: torch.Tensor | None):
    """Right-padded batch: feats f_t [B, L, H], next tokens x_{t+1} [B, L], feature targets f_{t+1},
    token targets x_{t+2} (-100 outside the answer / padding / the reduced vocabulary), valid [B, L]."""
    chosen = [seqs[i] for i in idx]
    L = max(s["tokens"].numel() - 1 for s in chosen)
    H = chosen[0]["hidden"].shape[-1]
    B = len(chosen)
    f = torch.zeros(B, L, H)
    f_next = torch.zeros(B, L, H)
    x_next = torch.zeros(B, L, dtype=torch.long)
    y = torch.full((B, L), -100, dtype=torch.long)
    valid = torch.zeros(B, L, dtype=torch.bool)
    for b, s in enumerate(chosen):
        toks, hid, n0 = s["tokens"], s["hidden"].float(), s["n_prompt"]
        n = toks.numel() - 1  # pairs t = 0 .. T-2
        f[b, :n] = hid[:-1]
        f_next[b, :n] = hid[1:]
        x_next[b, :n] = toks[1:]
        valid[b, :n] = True
        t = torch.arange(max(n0 - 1, 0), n - 1)  # x_{t+2} is an answer token
        tt = toks[t + 2]
        if vocab_map is not None:
            tt = vocab_map[tt]
        y[b, t] = tt
    return f, x_next, f_next, y, valid


def top_token_ids(seqs: list[dict], n: int, vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s["tokens"], minlength=vocab)[:vocab]
    n = min(n, vocab)
    return torch.sort(torch.topk(counts, n).indices).values


# --- training ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainOptions:
    """``specdraft train``'s flags."""
    kind: str  # medusa | eagle | eagle3
    target: str
    data: str | None  # prompts jsonl (eagle3: or --synth)
    output: str  # the head directory (checkpoints, cached data)
    steps: int = 300
    lr: float | None = None  # default: 1e-3 (medusa, eagle), 3e-4 (eagle3)
    batch_size: int | None = None  # default: 256 positions (medusa), 4 sequences (eagle), 2 (eagle3)
    max_new_tokens: int = 96
    max_prompts: int | None = None
    max_prompt_tokens: int | None = None
    heads: int = 3  # medusa
    blocks: int = 1  # medusa
    draft_vocab: int | None = None  # eagle; eagle3 (default EAGLE3_DRAFT_VOCAB)
    synth: int | None = None  # eagle3: prompts the target writes itself (Magpie)
    synth_temperature: float = 1.0
    synth_max_tokens: int = 96
    gen_backend: str = "auto"  # eagle3: the backend that writes prompts and answers (auto: llama if it can)
    gen_batch: int = 16
    ttt_steps: int = 5  # eagle3: draft steps of the training-time test
    intermediate_size: int | None = None  # eagle3: the head's MLP width (default EAGLE3_INTERMEDIATE)
    max_len: int = 768  # eagle3: tokens of a sequence trained on (prompt + answer, cut)
    device: str = "auto"  # eagle3: where the head trains (auto: cuda when there is one)
    data_only: bool = False  # eagle3: build the data, do not train
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


def add_parser(sub):
    t = sub.add_parser("train", help="train a Medusa, EAGLE or EAGLE-3 head on the target's own answers "
                       "(self-distillation)")
    t.add_argument("kind", choices=["medusa", "eagle", "eagle3"], help="which head to train")
    t.add_argument("--target", required=True, help="the target model (name, directory or .gguf)")
    t.add_argument("--data", default=None, help="prompts jsonl (turns / prompt / text field per line); eagle3: "
                   "or --synth")
    t.add_argument("-o", "--output", required=True, help="head directory (checkpoints, cached data)")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--lr", type=float, default=None, help="default 1e-3 (medusa, eagle), 3e-4 (eagle3)")
    t.add_argument("--batch-size", type=int, default=None,
                   help="positions per step (medusa, default 256) or sequences per step (eagle 4, eagle3 2)")
    t.add_argument("--max-new-tokens", type=int, default=96, help="tokens the target answers per prompt")
    t.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts")
    t.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="skip prompts longer than N tokens (long prompts cost most of the data time)")
    t.add_argument("--heads", type=int, default=3, help="medusa: number of heads (K)")
    t.add_argument("--blocks", type=int, default=1, help="medusa: residual blocks per head")
    t.add_argument("--draft-vocab", type=int, default=None,
                   help="eagle: draft over the N most frequent tokens of the data only")
    add_eagle3_args(t)
    t.add_argument("--checkpoint-every", type=int, default=50)
    t.add_argument("--resume", action="store_true", help="continue from the checkpoint in -o DIR")
    t.add_argument("--no-chat", action="store_true", help="feed raw prompts instead of the chat template")
    t.add_argument("--threads", type=int, default=None)
    t.add_argument("--seed", type=int, default=0)
    cluster.add_ray_args(t, "generate the training data (the target's answers and features) on Ray worker actors, "
                 "prompts sharded over them in batches, each worker loading the target once; the data is "
                 "gathered here and saved as usual, and training runs here. No value: a local Ray instance; "
                 "else a cluster address (auto, HOST:PORT); write --ray=ADDRESS, or --ray after KIND")
    t.set_defaults(command=None)
    return t


def add_eagle3_args(t) -> None:
    t.add_argument("--synth", type=int, default=None, metavar="N",
                   help="eagle3: N prompts written by the target itself from its chat template's user prefix "
                   "(Magpie), sampled with --seed; kept in -o DIR/data/ and extended on the next run")
    t.add_argument("--synth-temperature", type=float, default=1.0)
    t.add_argument("--synth-max-tokens", type=int, default=96, help="eagle3: longest synthesized prompt")
    t.add_argument("--gen-backend", choices=["auto", "llama", "hf", "openvino"], default="auto",
                   help="eagle3: the backend that writes prompts and answers, many rows per forward (auto: "
                   "llama.cpp where the target has a GGUF file, else transformers); features always come from "
                   "one transformers forward")
    t.add_argument("--gen-batch", type=int, default=16, help="eagle3: sequences decoded together")
    t.add_argument("--ttt-steps", type=int, default=5, help="eagle3: draft steps of the training-time test")
    t.add_argument("--intermediate-size", type=int, default=None, help="eagle3: the head's MLP width")
    t.add_argument("--max-len", type=int, default=768, help="eagle3: tokens per training sequence (cut)")
    t.add_argument("--device", default="auto", help="eagle3: cpu, cuda, cuda:N or auto")
    t.add_argument("--data-only", action="store_true", help="eagle3: build (or extend) the data, do not train")


def check_options(opts: TrainOptions) -> tuple[TrainOptions, dict | None]:
    """The options checked (and the batch size defaulted) before anything loads; -> (options, the saved
    head's config when resuming)."""
    if opts.batch_size is None:
        opts = replace(opts, batch_size={"medusa": 256, "eagle": 4}.get(opts.kind, 2))
    if opts.lr is None:
        opts = replace(opts, lr=3e-4 if opts.kind == "eagle3" else 1e-3)
    if opts.draft_vocab is not None and (opts.kind == "medusa" or opts.draft_vocab < 1):
        raise ConfigError("--draft-vocab N (N >= 1) is for eagle and eagle3 heads only")
    if opts.kind == "eagle3":
        check_eagle3_options(opts)
    elif opts.data is None:
        raise ConfigError(f"train {opts.kind} needs --data PROMPTS.jsonl")
    out = Path(opts.output)
    opts.ray_options().check()
    if opts.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {opts.steps}")
    if opts.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {opts.batch_size}")
    if opts.max_prompt_tokens is not None and opts.max_prompt_tokens < 1:
        raise ConfigError(f"--max-prompt-tokens must be >= 1, got {opts.max_prompt_tokens}")
    if opts.checkpoint_every < 1:
        raise ConfigError(f"--checkpoint-every must be >= 1, got {opts.checkpoint_every}")
    if opts.kind == "medusa" and opts.heads < 1:
        raise ConfigError(f"--heads must be >= 1, got {opts.heads}")
    if opts.data is not None and not Path(opts.data).exists():
        raise SpecDraftError(f"--data {opts.data} not found")
    if not opts.resume:
        return opts, None
    if not (out / STATE_FILE).exists():
        raise SpecDraftError(f"--resume: no checkpoint in {out} (need config.json, head.safetensors, {STATE_FILE})")
    saved = read_head_config(out)
    if saved["type"] != opts.kind:
        raise ConfigError(f"--resume: {out} holds a {saved['type']} head, not {opts.kind}")
    if saved.get("target") != opts.target:
        raise ConfigError(f"--resume: {out} was trained for target {saved.get('target')!r}, not {opts.target!r}")
    return opts, saved


def medusa_setup(target, seqs: list[dict], saved: dict | None, opts: TrainOptions):
    """-> (the heads, loss(generator) of one batch)."""
    H, V = target.facts.hidden_size, target.vocab_size
    lm_w, lm_b = target.output_rows(), None
    K = saved["heads"] if saved else opts.heads
    blocks = saved.get("blocks", 1) if saved else opts.blocks
    head = MedusaHeads(H, K, blocks)
    X, Y = medusa_examples(seqs, K)
    print(f"medusa: {K} heads x {blocks} block(s), {X.shape[0]} answer positions", file=sys.stderr)

    def loss(g):
        idx = torch.randint(0, X.shape[0], (opts.batch_size,), generator=g)
        h = head(X[idx])  # [B, K, H]
        logits = nn.functional.linear(h, lm_w, lm_b)
        return nn.functional.cross_entropy(logits.reshape(-1, V), Y[idx].reshape(-1), ignore_index=-100)

    return head, loss


def eagle_setup(target, seqs: list[dict], saved: dict | None, opts: TrainOptions):
    """-> (the head, loss(generator) of one batch)."""
    V = target.vocab_size
    lm_w, lm_b = target.output_rows(), None
    n_vocab = saved.get("draft_vocab") if saved else opts.draft_vocab
    ids = top_token_ids(seqs, n_vocab, V) if n_vocab else None
    head = EagleHead(target.facts, ids)
    vocab_map = None
    if ids is not None:
        vocab_map = torch.full((V,), -100, dtype=torch.long)
        vocab_map[ids] = torch.arange(ids.numel())
        w_cls = lm_w.index_select(0, ids)
        b_cls = None
    else:
        w_cls, b_cls = lm_w, lm_b
    emb = target.embed
    print(f"eagle: 1 decoder layer, {len(seqs)} sequences, draft vocabulary {ids.numel() if ids is not None else V}",
          file=sys.stderr)

    def loss(g):
        idx = torch.randint(0, len(seqs), (opts.batch_size,), generator=g).tolist()
        f, x_next, f_next, y, valid = eagle_batch(seqs, idx, vocab_map)
        with torch.no_grad():
            e = emb(x_next)
        pred = head(f, e)
        reg = nn.functional.smooth_l1_loss(pred[valid], f_next[valid])
        logits = nn.functional.linear(pred, w_cls, b_cls)
        ce = (nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
              if (y >= 0).any() else pred.sum() * 0)
        return reg + 0.1 * ce

    return head, loss


def train_main(opts: TrainOptions, ray_builder=None) -> int:
    """``ray_builder(ray options, target)``: build_data's stand-in for --ray (bench/shard.py's data_builder,
    which the CLI passes: the scale package sits above this module)."""
    from ..api import SpecDecoder

    opts, saved = check_options(opts)
    if opts.kind == "eagle3":
        return eagle3_main(opts, saved)
    if opts.ray is not None and ray_builder is None:
        raise ConfigError("--ray needs the Ray data builder: train_main(opts, scale.shard.data_builder)")
    out = Path(opts.output)
    torch.manual_seed(opts.seed)
    dec = SpecDecoder.load(opts.target, dtype="float32", threads=opts.threads, backend="hf")  # the heads read its features
    target = dec.target
    for p in target.model.parameters():
        p.requires_grad_(False)
    build = ray_builder(opts.ray_options(), opts.target) if opts.ray is not None else build_data
    seqs, data_meta = load_or_build_data(dec, out, opts.data, opts.target, opts.max_new_tokens, not opts.no_chat,
                                         opts.max_prompts, opts.max_prompt_tokens, build)
    head, loss = (medusa_setup if opts.kind == "medusa" else eagle_setup)(target, seqs, saved, opts)
    return fit(head, loss, target, opts, saved, data_meta)


def fit(head, loss, target, opts: TrainOptions, saved: dict | None, data_meta: dict) -> int:
    """AdamW on the head's weights from step 0 or the checkpoint's, until ``opts.steps``; prints the result."""
    out = Path(opts.output)
    head.train()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=opts.lr, weight_decay=0.0)
    step, losses = 0, []
    if saved:
        step, losses = _restore(head, opt, out)
        print(f"resuming from step {step}", file=sys.stderr)
        if step >= opts.steps:
            print(f"already at step {step} >= --steps {opts.steps}; nothing to do", file=sys.stderr)
            return 0
    command = "specdraft " + " ".join(sys.argv[1:]) if opts.command is None else opts.command
    extra = {"target": opts.target, "target_signature": target_signature(target), "data": str(opts.data),
             "data_meta": data_meta, "command": command, "lr": opts.lr, "batch_size": opts.batch_size, "seed": opts.seed}
    train_s = float(saved.get("train_s", 0.0)) if saved else 0.0
    step, train_s = run_steps(head, opt, loss, opts, out, step, losses, train_s, extra)
    print(json.dumps({"head": str(out), "type": opts.kind, "step": step, "loss_first": losses[0],
                      "loss_last10": sum(losses[-10:]) / len(losses[-10:]), "train_s": round(train_s, 1)}))
    return 0


def _restore(head, opt, out: Path) -> tuple[int, list[float]]:
    """The checkpoint in ``out`` loaded into ``head`` and ``opt``; -> (its step, its losses)."""
    from safetensors.torch import load_file

    st = torch.load(out / STATE_FILE, weights_only=False)
    # the float32 weights (an int8-stored head keeps them here only), else the head file's
    head.load_state_dict(st["weights"] if "weights" in st else load_file(str(out / "head.safetensors")))
    opt.load_state_dict(st["optimizer"])
    return int(st["step"]), list(st.get("losses", []))


def _checkpoint(head, opt, out: Path, extra: dict, step: int, losses: list[float], train_s: float) -> None:
    int8 = head.meta()["type"] == "eagle3"  # shipped in int8 (heads.Eagle3Head's sizes)
    save_head(head, out, {**extra, "step": step, "loss_first": losses[0] if losses else None,
                          "loss_last": float(sum(losses[-10:]) / max(len(losses[-10:]), 1)) if losses else None,
                          "train_s": round(train_s, 1)}, int8=int8)
    state = {"optimizer": opt.state_dict(), "step": step, "losses": losses}
    if int8:
        state["weights"] = {k: v.detach().cpu().clone() for k, v in head.state_dict().items()}
    torch.save(state, out / (STATE_FILE + ".tmp"))
    (out / (STATE_FILE + ".tmp")).replace(out / STATE_FILE)


def run_steps(head, opt, loss_of, opts: TrainOptions, out: Path, step: int, losses: list[float], train_s: float,
              extra: dict) -> tuple[int, float]:
    """Steps until ``opts.steps``, each on the batch the generator seeded by (seed, step) draws (so a resumed
    run sees an uninterrupted run's batches), a checkpoint every ``checkpoint_every``; -> (step, train_s)."""
    t0 = time.perf_counter()
    bar = _tqdm(total=opts.steps, initial=step, desc=f"train {opts.kind}", unit="step")
    while step < opts.steps:
        g = torch.Generator().manual_seed(opts.seed * 1_000_003 + step)
        loss = loss_of(g)
        opt.zero_grad()
        loss.backward()
        if opts.kind == "eagle3":  # EAGLE's clipping: early steps on features of magnitude 1e4 spike otherwise
            nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        step += 1
        losses.append(float(loss.detach()))
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{losses[-1]:.3f}", **getattr(loss_of, "postfix", {}))
            bar.update(1)
        if step % opts.checkpoint_every == 0 or step == opts.steps:
            train_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            _checkpoint(head, opt, out, extra, step, losses, train_s)
    if hasattr(bar, "close"):
        bar.close()
    return step, train_s


# --- EAGLE-3: data that grows and resumes -------------------------------------------------------
# DIR/data/: meta.json (what the data was made with), synth.jsonl (every synthesized draw, kept or
# not: a resumed run continues at the next draw's seed), answers.jsonl (prompt + the target's greedy
# answer, one line per prompt), features.bin (bf16 [tokens, 3H], the three layers' outputs of every
# position, appended) and features.jsonl (where each sequence's rows start). Each file is appended
# after every batch, so a run stopped at any point loses at most one batch.
def check_eagle3_options(opts: TrainOptions) -> None:
    if (opts.data is None) == (opts.synth is None):
        raise ConfigError("train eagle3 needs exactly one of --data PROMPTS.jsonl and --synth N")
    for name in ("synth", "gen_batch", "ttt_steps", "max_len", "synth_max_tokens", "intermediate_size"):
        v = getattr(opts, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if opts.max_len < opts.ttt_steps + 2:
        raise ConfigError(f"--max-len {opts.max_len} leaves no room for {opts.ttt_steps} draft steps")


def _append_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def _read_jsonl(path: Path) -> list[dict]:
    """The complete lines of an appended file (a line torn by a stopped run is dropped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def data_meta(opts: TrainOptions, layers, out: Path) -> dict:
    """What DIR/data was made with; a run with other settings is refused (it would mix data)."""
    want = {"target": opts.target, "layers": list(layers), "max_new_tokens": opts.max_new_tokens,
            "chat": not opts.no_chat, "prompts": str(opts.data) if opts.data else "synth",
            "max_prompt_tokens": opts.max_prompt_tokens}
    if opts.synth:
        want.update(seed=opts.seed, synth_temperature=opts.synth_temperature, synth_max_tokens=opts.synth_max_tokens)
    f = out / "data" / "meta.json"
    if f.exists():
        have = json.loads(f.read_text())
        if have != want:
            diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
            raise ConfigError(f"{out}/data was made with other settings ({', '.join(diff)}: "
                              f"{[have.get(k) for k in diff]}); use another -o DIR or the same settings")
    else:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(want, indent=1))
    return want


def user_prefix(tokenizer) -> list[int]:
    """The chat template up to where the user's text starts (its default system prompt included): what
    Magpie feeds an instruct model so that it writes a user turn."""
    mark = "\u2063MAGPIE\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    if mark not in text:
        raise ConfigError("the target's chat template does not show the user's text; --synth needs one")
    return [int(t) for t in tokenizer(text[: text.index(mark)], add_special_tokens=False)["input_ids"]]


def _decode(gen, jobs: list[tuple[list[int], dict]], eos: set[int]) -> list:
    """The jobs ((prompt ids, sampling fields)) decoded plainly together on ``gen`` (any backend)."""
    from ..core.config import SamplingParams
    from ..drafters.base import NoDrafter
    from ..engine import generate_batch

    return generate_batch(gen, [(ids, SamplingParams(**sp), NoDrafter()) for ids, sp in jobs], eos_ids=eos,
                          max_batch=len(jobs))


def _norm_text(s: str) -> str:
    return " ".join(s.lower().split())


SYNTH_TRIES = 20  # draws per wanted prompt before synthesis gives up (a model that never ends a turn)


def synth_prompts(gen, tokenizer, opts: TrainOptions, data: Path) -> list[str]:
    """``opts.synth`` distinct prompts written by the target from its user prefix (Magpie): draw i samples
    at ``synth_temperature`` with seed (seed, i); a draw is kept if it ended (EOS, not the token limit),
    holds at least 8 characters and is new (case and spacing ignored). Continues the draws in
    synth.jsonl."""
    log = data / "synth.jsonl"
    draws = _read_jsonl(log)
    kept = [d["text"] for d in draws if d["kept"]]
    seen = {_norm_text(t) for t in kept}
    prefix, eos = user_prefix(tokenizer), gen.eos_token_ids()
    bar = _tqdm(total=opts.synth, initial=min(len(kept), opts.synth), desc="synthesize prompts", unit="prompt")
    while len(kept) < opts.synth:
        first = len(draws)
        if first >= SYNTH_TRIES * opts.synth + opts.gen_batch:
            raise SpecDraftError(f"only {len(kept)} of {first} synthesized prompts ended within --synth-max-tokens "
                                 f"{opts.synth_max_tokens} and were new; raise it or pass --data PROMPTS.jsonl")
        sp = {"temperature": opts.synth_temperature, "max_new_tokens": opts.synth_max_tokens}
        seeds = [opts.seed * 1_000_003 + first + j for j in range(opts.gen_batch)]
        outs = _decode(gen, [(prefix, {**sp, "seed": s}) for s in seeds], eos)
        new = []
        for j, o in enumerate(outs):
            text = tokenizer.decode(o.token_ids, skip_special_tokens=True).strip()
            take = (o.stats.finish_reason != "length" and len(text) >= 8 and _norm_text(text) not in seen
                    and len(kept) < opts.synth)
            if take:
                seen.add(_norm_text(text))
                kept.append(text)
                bar.update(1)
            new.append({"draw": first + j, "text": text, "kept": take})
        _append_jsonl(log, new)
        draws += new
    bar.close()
    return kept[: opts.synth]


def answer_prompts(gen, dec, prompts: list[str], opts: TrainOptions, data: Path) -> list[dict]:
    """The target's greedy answer to every prompt (chat template unless --no-chat) not answered yet in
    answers.jsonl, ``gen_batch`` rows at a time on ``gen``; -> every answered sequence, in prompt order."""
    f = data / "answers.jsonl"
    have = {r["i"]: r for r in _read_jsonl(f)}
    todo = []
    for i, p in enumerate(prompts):
        if i in have:
            continue
        ids = dec.encode(p, chat=not opts.no_chat)
        if len(ids) + opts.max_new_tokens <= gen.max_context and len(ids) <= (opts.max_prompt_tokens or len(ids)):
            todo.append((i, ids))
    todo.sort(key=lambda x: len(x[1]))  # rows of one batch finish prefilling together
    eos = gen.eos_token_ids()
    bar = _tqdm(total=len(have) + len(todo), initial=len(have), desc=f"answers ({gen.backend})", unit="prompt")
    t0, made = time.perf_counter(), 0
    for b in range(0, len(todo), opts.gen_batch):
        chunk = todo[b: b + opts.gen_batch]
        outs = _decode(gen, [(ids, {"max_new_tokens": opts.max_new_tokens}) for _, ids in chunk], eos)
        rows = [{"i": i, "tokens": ids + o.token_ids, "n_prompt": len(ids)} for (i, ids), o in zip(chunk, outs)]
        _append_jsonl(f, rows)
        have.update((r["i"], r) for r in rows)
        made += sum(len(o.token_ids) for o in outs)
        bar.set_postfix(tok_s=f"{made / (time.perf_counter() - t0):.1f}")
        bar.update(len(chunk))
    bar.close()
    return [have[i] for i in sorted(have) if i < len(prompts)]


def layer_features(model, tokens: list[int], layers) -> torch.Tensor:
    """[T, len(layers) * H]: the target's hidden states at ``layers`` (output_hidden_states' indices) for
    every position, from one plain forward (what the drafter gets handed over in a verifying forward)."""
    with torch.inference_mode():
        out = model.model(input_ids=torch.tensor([tokens], device=model.device), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)


def extract_features(target, answers: list[dict], layers, data: Path) -> None:
    """Append the layer features of every answered sequence not in features.jsonl yet (bf16 rows of
    features.bin; the index line is written after its rows, and rows past the index, left by a stopped
    run, are cut off first)."""
    index, binf = data / "features.jsonl", data / "features.bin"
    done = _read_jsonl(index)
    width = len(layers) * int(target.config.hidden_size)
    rows = sum(r["n"] for r in done)
    with open(binf, "ab") as f:
        f.truncate(rows * width * 2)
    have = {r["i"] for r in done}
    todo = [a for a in answers if a["i"] not in have]
    bar = _tqdm(total=sum(len(a["tokens"]) for a in todo), desc="features", unit="tok")
    with open(binf, "ab") as f:
        for a in todo:
            x = layer_features(target.model, a["tokens"], layers).to(torch.bfloat16).cpu()
            f.write(x.view(torch.int16).numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
            _append_jsonl(index, [{"i": a["i"], "row": rows, "n": x.shape[0]}])
            rows += x.shape[0]
            bar.update(x.shape[0])
    bar.close()


class Eagle3Data:
    """The sequences with features, read from DIR/data (features memory-mapped)."""

    def __init__(self, data: Path, width: int):
        import numpy as np

        answers = {r["i"]: r for r in _read_jsonl(data / "answers.jsonl")}
        self.index = [r for r in _read_jsonl(data / "features.jsonl") if r["i"] in answers]
        if not self.index:
            raise SpecDraftError(f"{data} holds no sequences with features yet")
        self.tokens = [torch.tensor(answers[r["i"]]["tokens"], dtype=torch.long) for r in self.index]
        self.n_prompt = [answers[r["i"]]["n_prompt"] for r in self.index]
        n = sum(r["n"] for r in self.index)
        # copy-on-write: torch wants a writable array; nothing writes to it
        mm = np.memmap(data / "features.bin", dtype=np.int16, mode="c", shape=(n, width))
        self.feats = torch.from_numpy(mm).view(torch.bfloat16)  # read-only; rows are copied per batch

    def __len__(self) -> int:
        return len(self.index)

    def features(self, k: int, n: int) -> torch.Tensor:
        r = self.index[k]["row"]
        return self.feats[r: r + n].float()


def draft_vocab(data: Eagle3Data, n: int, vocab: int) -> torch.Tensor:
    """The n most frequent answer tokens (ties: the lower id), sorted: the draft vocabulary (d2t)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for toks, n0 in zip(data.tokens, data.n_prompt):
        counts += torch.bincount(toks[n0:], minlength=vocab)[:vocab]
    order = torch.sort(counts, descending=True, stable=True).indices[: min(n, vocab)]
    covered = float(counts[order].sum()) / max(float(counts.sum()), 1.0)
    print(f"eagle3: draft vocabulary of {order.numel()} tokens covers {covered:.1%} of the answer tokens",
          file=sys.stderr)
    return torch.sort(order).values


# --- EAGLE-3: the training-time test -----------------------------------------------------------
def ttt_batch(data: Eagle3Data, idx: list[int], t2d: torch.Tensor, K: int, max_len: int):
    """Right-padded batch of P = L - 1 anchors: features F_t [B, P, 3H]; tokens [B, P + K] (x_{t+1}
    onwards: step j feeds column t + j); labels [B, P, K] (step j at anchor t: x_{t+j+2} as a draft
    vocabulary index, -100 off the answer, past the end or outside the draft vocabulary)."""
    seqs = [(data.tokens[i][:max_len], data.n_prompt[i], i) for i in idx]
    P = max(len(t) for t, _, _ in seqs) - 1
    width = data.feats.shape[1]
    F = torch.zeros(len(seqs), P, width)
    toks = torch.zeros(len(seqs), P + K, dtype=torch.long)
    labels = torch.full((len(seqs), P, K), -100, dtype=torch.long)
    for b, (x, n0, i) in enumerate(seqs):
        T = len(x)
        F[b, : T - 1] = data.features(i, T - 1)
        toks[b, : T - 1] = x[1:]
        t = torch.arange(T - 1)
        for j in range(K):
            at = t + j + 2
            ok = (at < T) & (at >= n0)
            labels[b, t[ok], j] = t2d[x[at[ok]]]
    return F, toks, labels


def ttt_mask(P: int, j: int, dtype: torch.dtype) -> torch.Tensor:
    """Step j's additive mask [1, 1, P, (j + 1) P] over the head's cache of steps 0..j: anchor t sees
    step 0's positions <= t (the true context) and its own entries of steps 1..j (its draft so far),
    as a chain drafted from anchor t attends at test time."""
    blocks = [torch.tril(torch.ones(P, P, dtype=torch.bool))] + [torch.eye(P, dtype=torch.bool)] * j
    allow = torch.cat(blocks, dim=1)
    return torch.zeros(allow.shape, dtype=dtype).masked_fill(~allow, torch.finfo(dtype).min)[None, None]


TTT_DECAY = 0.8  # step j's loss weight is 0.8^j (EAGLE-3's and SpecForge's)


def ttt_loss(head, embed, F, toks, labels, device) -> tuple[torch.Tensor, list[float]]:
    """The training-time test over K = labels.shape[-1] draft steps: step 0 reads the target's fused
    features, step j >= 1 the head's own output of step j - 1 at the same anchor, one position further
    on (t + j), with step j - 1's keys in the cache. -> (sum_j 0.8^j cross-entropy_j, step accuracies)."""
    B, P, K = labels.shape
    cache = head.new_cache()
    feats = F.to(device)
    labels = labels.to(device)
    total, accs = 0.0, []
    for j in range(K):
        with torch.no_grad():
            e = embed(toks[:, j: j + P].to(embed.weight.device)).to(device)
        pos = (torch.arange(P, device=device) + j)[None].expand(B, P)
        mask = ttt_mask(P, j, feats.dtype).to(device).expand(B, 1, P, (j + 1) * P)
        out = head(feats, e, cache=cache, position_ids=pos, attention_mask=mask)
        logits = head.draft_logits(out)
        y = labels[:, :, j]
        ok = y >= 0
        if ok.any():
            total = total + TTT_DECAY ** j * nn.functional.cross_entropy(logits[ok], y[ok])
            accs.append(float((logits[ok].argmax(-1) == y[ok]).float().mean()))
        feats = out
    if not torch.is_tensor(total):
        total = out.sum() * 0
    return total, accs


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: torch sees no CUDA device here")
    return torch.device(name)


def eagle3_setup(target, data: Eagle3Data, layers, saved: dict | None, opts: TrainOptions, device):
    """-> (the head on ``device``, loss(generator) of one batch). A new head's LM head starts as the
    target's rows of the draft vocabulary; its final norm starts at 1, not the target's (whose scale on
    the untrained layer's output made the first losses 1.6x higher on SmolLM2)."""
    from ..models.heads import EAGLE3_DRAFT_VOCAB, EAGLE3_INTERMEDIATE, Eagle3Head, build_head

    V = target.vocab_size
    if saved:
        head = build_head(saved, target)  # its weights and draft_ids come from the checkpoint
    else:
        ids = draft_vocab(data, opts.draft_vocab or EAGLE3_DRAFT_VOCAB, V)
        head = Eagle3Head(target.config, layers, ids, opts.intermediate_size or EAGLE3_INTERMEDIATE)
        with torch.no_grad():
            w = lm_head_of(target).weight.detach()
            head.lm_head.weight.copy_(w.index_select(0, ids.to(w.device)))
    n = sum(p.numel() for p in head.parameters())
    print(f"eagle3: layers {list(head.layers)}, {n / 1e6:.1f}M parameters, draft vocabulary "
          f"{head.draft_ids.numel()}, {len(data)} sequences, {opts.ttt_steps} draft steps, on {device}",
          file=sys.stderr)
    head = head.to(device)
    embed = embed_of(target)

    t2d = []  # target id -> draft index; made on the first batch (a resumed head's ids load after setup)

    def loss(g):
        idx = torch.randint(0, len(data), (opts.batch_size,), generator=g).tolist()
        if not t2d:
            t2d.append(torch.full((V,), -100, dtype=torch.long))
            t2d[0][head.draft_ids.cpu()] = torch.arange(head.draft_ids.numel())
        F, toks, labels = ttt_batch(data, idx, t2d[0], opts.ttt_steps, opts.max_len)
        total, accs = ttt_loss(head, embed, F, toks, labels, device)
        loss.postfix = {"acc": "/".join(f"{a:.2f}" for a in accs)}
        return total

    return head, loss


def generation_model(opts: TrainOptions, dec):
    """The model that writes prompts and answers: the target on --gen-backend (auto: llama.cpp where
    the target has a GGUF file, since it decodes many rows per forward on 4-bit weights; else the
    transformers target already loaded)."""
    from ..models.backends import load_model

    if opts.gen_backend == "hf":
        return dec.target
    try:
        return load_model(opts.target, backend="llama" if opts.gen_backend == "auto" else opts.gen_backend)
    except (SpecDraftError, ImportError, OSError) as e:
        if opts.gen_backend != "auto":
            raise
        print(f"eagle3: answers on transformers ({str(e).splitlines()[0]})", file=sys.stderr)
        return dec.target


def eagle3_data(opts: TrainOptions, dec, layers, out: Path, device: torch.device) -> dict:
    """Prompts (--data, or synthesized), the target's answers and their features, each stage continuing
    what DIR/data holds; -> the data's meta. On a GPU (``device``) the features' forwards run there."""
    from ..core.prompts import load_prompts

    meta = data_meta(opts, layers, out)
    data = out / "data"
    gen = None
    if opts.synth:
        gen = generation_model(opts, dec)
        prompts = synth_prompts(gen, dec.tokenizer, opts, data)
    else:
        prompts = [r["prompt"] for r in load_prompts(opts.data)][: opts.max_prompts or None]
    if len(_read_jsonl(data / "answers.jsonl")) < len(prompts):
        gen = gen or generation_model(opts, dec)
    answers = answer_prompts(gen, dec, prompts, opts, data) if gen is not None else \
        [r for r in _read_jsonl(data / "answers.jsonl") if r["i"] < len(prompts)]
    if device.type != "cpu":  # after the answers: the engine's transformers rows stay on the CPU
        dec.target.model.to(device)
    extract_features(dec.target, answers, layers, data)
    return {**meta, "n_prompts": len(prompts), "n_seqs": len(answers),
            "n_tokens": sum(len(a["tokens"]) for a in answers)}


def eagle3_main(opts: TrainOptions, saved: dict | None) -> int:
    """``train eagle3``: the data (each stage resumable), then the training-time test."""
    from ..api import SpecDecoder
    from ..models.heads import eagle3_layers

    out = Path(opts.output)
    torch.manual_seed(opts.seed)
    dec = SpecDecoder.load(opts.target, dtype="float32", threads=opts.threads, backend="hf")  # the head reads its features
    target = dec.target
    for p in target.model.parameters():
        p.requires_grad_(False)
    layers = tuple(saved["layers"]) if saved else eagle3_layers(target.num_layers)
    device = _device(opts.device)
    meta = eagle3_data(opts, dec, layers, out, device)
    print(f"eagle3 data: {meta['n_seqs']} sequences, {meta['n_tokens']} tokens", file=sys.stderr)
    if opts.data_only:
        print(json.dumps({"data": str(out / "data"), **meta}))
        return 0
    data = Eagle3Data(out / "data", len(layers) * int(target.config.hidden_size))
    head, loss = eagle3_setup(target, data, layers, saved, opts, device)
    return fit(head, loss, target, opts, saved, meta)
