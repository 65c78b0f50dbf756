"""``specdraft train medusa|eagle``: train a draft head on the target's own outputs (self-distillation).

1. Data (cached in DIR/data.pt, reused by later runs and by ``--resume``): the target answers each
   prompt greedily itself (transformers ``generate``, batched; chat template unless ``--no-chat``);
   one forward over prompt + answer gives its features (final-norm outputs) at every position. Those
   features and tokens are the training data, so the head learns what this target would say.
   ``--ray [ADDRESS]`` answers the same batches on Ray worker actors (scale/shard.py's data_builder).
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
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from .scale import cluster
from .errors import ConfigError, SpecDraftError
from .heads import EagleHead, MedusaHeads, embed_of, lm_head_of, read_head_config, save_head, target_signature

DATA_FILE = "data.pt"
STATE_FILE = "train_state.pt"


def _tqdm(it=None, **kw):
    try:
        from tqdm import tqdm

        return tqdm(it, file=sys.stderr, **kw)
    except ImportError:  # pragma: no cover
        return it


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
    ``train --ray`` answers the same batches on Ray workers (scale/shard.py's data_builder)."""
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
    scale/shard.py's data_builder's), saved in DIR/data.pt."""
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
    from .prompts import load_prompts

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
    kind: str  # medusa | eagle
    target: str
    data: str  # prompts jsonl
    output: str  # the head directory (checkpoints, cached data)
    steps: int = 300
    lr: float = 1e-3
    batch_size: int | None = None  # default: 256 positions (medusa), 4 sequences (eagle)
    max_new_tokens: int = 96
    max_prompts: int | None = None
    max_prompt_tokens: int | None = None
    heads: int = 3  # medusa
    blocks: int = 1  # medusa
    draft_vocab: int | None = None  # eagle
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
    t = sub.add_parser("train", help="train a Medusa or EAGLE head on the target's own answers (self-distillation)")
    t.add_argument("kind", choices=["medusa", "eagle"], help="which head to train")
    t.add_argument("--target", required=True, help="the target model (name, directory or .gguf)")
    t.add_argument("--data", required=True, help="prompts jsonl (turns / prompt / text field per line)")
    t.add_argument("-o", "--output", required=True, help="head directory (checkpoints, cached data)")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--batch-size", type=int, default=None,
                   help="positions per step (medusa, default 256) or sequences per step (eagle, default 4)")
    t.add_argument("--max-new-tokens", type=int, default=96, help="tokens the target answers per prompt")
    t.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts")
    t.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="skip prompts longer than N tokens (long prompts cost most of the data time)")
    t.add_argument("--heads", type=int, default=3, help="medusa: number of heads (K)")
    t.add_argument("--blocks", type=int, default=1, help="medusa: residual blocks per head")
    t.add_argument("--draft-vocab", type=int, default=None,
                   help="eagle: draft over the N most frequent tokens of the data only")
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


def check_options(opts: TrainOptions) -> tuple[TrainOptions, dict | None]:
    """The options checked (and the batch size defaulted) before anything loads; -> (options, the saved
    head's config when resuming)."""
    if opts.batch_size is None:
        opts = replace(opts, batch_size=256 if opts.kind == "medusa" else 4)
    if opts.draft_vocab is not None and (opts.kind != "eagle" or opts.draft_vocab < 1):
        raise ConfigError("--draft-vocab N (N >= 1) is for eagle heads only")
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
    if not Path(opts.data).exists():
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
    H, V = int(target.config.hidden_size), target.vocab_size
    lm_w, lm_b = lm_head_of(target).weight.detach(), getattr(lm_head_of(target), "bias", None)
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
    lm_w, lm_b = lm_head_of(target).weight.detach(), getattr(lm_head_of(target), "bias", None)
    n_vocab = saved.get("draft_vocab") if saved else opts.draft_vocab
    ids = top_token_ids(seqs, n_vocab, V) if n_vocab else None
    head = EagleHead(target.config, ids)
    vocab_map = None
    if ids is not None:
        vocab_map = torch.full((V,), -100, dtype=torch.long)
        vocab_map[ids] = torch.arange(ids.numel())
        w_cls = lm_w.index_select(0, ids)
        b_cls = None if lm_b is None else lm_b.detach().index_select(0, ids)
    else:
        w_cls, b_cls = lm_w, lm_b
    emb = embed_of(target)
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
    """``ray_builder(ray options, target)``: build_data's stand-in for --ray (scale/shard.py's data_builder,
    which the CLI passes: the scale package sits above this module)."""
    from .api import SpecDecoder

    opts, saved = check_options(opts)
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

    head.load_state_dict(load_file(str(out / "head.safetensors")))
    st = torch.load(out / STATE_FILE, weights_only=False)
    opt.load_state_dict(st["optimizer"])
    return int(st["step"]), list(st.get("losses", []))


def _checkpoint(head, opt, out: Path, extra: dict, step: int, losses: list[float], train_s: float) -> None:
    save_head(head, out, {**extra, "step": step, "loss_first": losses[0] if losses else None,
                          "loss_last": float(sum(losses[-10:]) / max(len(losses[-10:]), 1)) if losses else None,
                          "train_s": round(train_s, 1)})
    torch.save({"optimizer": opt.state_dict(), "step": step, "losses": losses}, out / (STATE_FILE + ".tmp"))
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
        opt.step()
        step += 1
        losses.append(float(loss.detach()))
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            bar.update(1)
        if step % opts.checkpoint_every == 0 or step == opts.steps:
            train_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            _checkpoint(head, opt, out, extra, step, losses, train_s)
    if hasattr(bar, "close"):
        bar.close()
    return step, train_s
