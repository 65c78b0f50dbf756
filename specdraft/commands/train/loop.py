"""The training loop every head kind shares: AdamW on the head's weights, batches drawn by a generator
seeded by (seed, step) so a resumed run sees an uninterrupted run's batches, progress with an ETA, and
checkpoints.

A checkpoint is the head as its kind saves it (``Kind.save``: a head directory others can load) and
``train_state.pt``: the float32 weights, the optimizer state, the step and the losses, written whole and
renamed into place at once; ``--resume`` reads only that file (the head's own files, written just
before it, can be a step ahead when a run is stopped in between). Both are loaded ``weights_only``: a
file planted in DIR cannot run code.
"""

from __future__ import annotations

import json
import pickle
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ...core.errors import SpecDraftError
from ...models.heads import load_weights

STATE_FILE = "train_state.pt"


def progress(it=None, **kw):
    """A tqdm progress bar on stderr (rate and ETA)."""
    from tqdm import tqdm

    return tqdm(it, file=sys.stderr, **kw)


def load_saved(path: Path, what: str) -> dict:
    """A dict ``torch.save`` wrote in -o DIR (tensors and plain values), loaded with ``weights_only``:
    a file planted there (or a head directory handed over) cannot run code when unpickled; -> the dict,
    or one error line naming the file."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise SpecDraftError(
            f"{what} {path} holds objects other than tensors and plain values; refused, since "
            "loading them could run code (delete it if you did not write it)"
        ) from None
    except Exception as e:  # noqa: BLE001 - torn, not a torch file, unreadable: every way a file is not ours
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SpecDraftError(f"{what} {path} cannot be read ({why}); delete it") from None
    if not isinstance(blob, dict):
        raise SpecDraftError(f"{what} {path} holds a {type(blob).__name__}, not what specdraft train writes; delete it")
    return blob


@dataclass
class Run:
    """One training run's head, loss and settings (``fit``'s input)."""

    head: nn.Module
    loss: Callable  # (generator) -> loss tensor; may set ``loss.postfix`` (shown on the bar)
    save: Callable  # (head, out: Path, extra: dict) -> None: the head directory of this kind
    out: Path
    steps: int
    lr: float
    seed: int
    checkpoint_every: int
    desc: str
    clip: float | None = None  # gradient norm clipping
    vocab_size: int = 0  # the target's (the draft ids a resumed head holds are checked against it)


def fit(run: Run, resume: bool, extra: dict) -> int:
    """AdamW from step 0, or from the checkpoint's when ``resume``, until ``run.steps``; prints the result."""
    run.head.train()
    opt = torch.optim.AdamW([p for p in run.head.parameters() if p.requires_grad], lr=run.lr, weight_decay=0.0)
    step, losses, train_s = 0, [], 0.0
    if resume:
        step, losses, train_s = restore(run, opt)
        print(f"resuming from step {step}", file=sys.stderr)
        if step >= run.steps:
            print(f"already at step {step} >= --steps {run.steps}; nothing to do", file=sys.stderr)
            return 0
    step, train_s = run_steps(run, opt, step, losses, train_s, extra)
    print(
        json.dumps(
            {
                "head": str(run.out),
                "type": run.desc,
                "step": step,
                "loss_first": losses[0],
                "loss_last10": sum(losses[-10:]) / len(losses[-10:]),
                "train_s": round(train_s, 1),
            }
        )
    )
    return 0


def restore(run: Run, opt) -> tuple[int, list[float], float]:
    """The checkpoint in ``run.out`` loaded into the head and ``opt``; -> (its step, losses, train seconds)."""
    f = run.out / STATE_FILE
    st = load_saved(f, "--resume: the training state")
    step, losses = st.get("step"), st.get("losses")
    if not (
        isinstance(st.get("weights"), dict)
        and isinstance(st.get("optimizer"), dict)
        and isinstance(step, int)
        and isinstance(losses, list)
        and len(losses) == step
        and all(isinstance(x, float) for x in losses)
    ):
        raise SpecDraftError(
            f"--resume: {f} is not a checkpoint of this specdraft version (it needs the weights, "
            "optimizer state, step and losses); train again without --resume"
        )
    load_weights(run.head, st["weights"], run.vocab_size, str(f))
    try:
        opt.load_state_dict(st["optimizer"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise SpecDraftError(f"--resume: the optimizer state in {f} does not fit this head ({e})") from None
    train_s = st.get("train_s")
    return step, losses, float(train_s) if isinstance(train_s, (int, float)) else 0.0


def checkpoint(run: Run, opt, extra: dict, step: int, losses: list[float], train_s: float) -> None:
    run.save(
        run.head,
        run.out,
        {
            **extra,
            "step": step,
            "loss_first": losses[0] if losses else None,
            "loss_last": float(sum(losses[-10:]) / max(len(losses[-10:]), 1)) if losses else None,
            "train_s": round(train_s, 1),
        },
    )
    state = {
        "optimizer": opt.state_dict(),
        "step": step,
        "losses": losses,
        "train_s": train_s,
        "weights": {k: v.detach().cpu().clone() for k, v in run.head.state_dict().items()},
    }
    torch.save(state, run.out / (STATE_FILE + ".tmp"))
    (run.out / (STATE_FILE + ".tmp")).replace(run.out / STATE_FILE)


def run_steps(run: Run, opt, step: int, losses: list[float], train_s: float, extra: dict) -> tuple[int, float]:
    """Steps until ``run.steps``, a checkpoint every ``checkpoint_every`` and at the end; -> (step, train_s)."""
    t0 = time.perf_counter()
    bar = progress(total=run.steps, initial=step, desc=f"train {run.desc}", unit="step")
    while step < run.steps:
        g = torch.Generator().manual_seed(run.seed * 1_000_003 + step)
        loss = run.loss(g)
        opt.zero_grad()
        loss.backward()
        if run.clip is not None:
            nn.utils.clip_grad_norm_(run.head.parameters(), run.clip)
        opt.step()
        step += 1
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", **getattr(run.loss, "postfix", {}))
        bar.update(1)
        if step % run.checkpoint_every == 0 or step == run.steps:
            train_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            checkpoint(run, opt, extra, step, losses, train_s)
    bar.close()
    return step, train_s
