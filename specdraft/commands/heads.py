"""``specdraft heads``: EAGLE-3 heads between formats.

    specdraft heads export SRC OUT [--format specforge|vllm|speculators] [--dtype bfloat16]
    specdraft heads info DIR
    specdraft heads reset [--target NAME]

``export`` reads a head directory of any of the three formats (models/head_formats.py; ours included) and
writes it in the one asked: ``specforge`` (the default; SGLang, SpecForge and vLLM read it),
``vllm`` (the same tensors, architecture Eagle3LlamaForCausalLM) or ``speculators``. A head stored
here in int8 is written dequantized, in ``--dtype``. ``reset`` removes the heads that online learning
adapted (``serve --learn``, specdraft/learning/store.py): of the target NAME (its name as served), or all;
the next start serves the shipped head.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ..core.errors import ConfigError
from ..models import head_formats

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_parser(sub):
    h = sub.add_parser("heads", help="EAGLE-3 heads: export to SpecForge / vLLM / speculators, show one")
    hs = h.add_subparsers(dest="heads_cmd", required=True)
    e = hs.add_parser("export", help="write an EAGLE-3 head in another engine's format")
    e.add_argument("src", help="a head directory (ours, SpecForge, vLLM or speculators)")
    e.add_argument("out", help="the directory to write (created; its config.json and model.safetensors are replaced)")
    e.add_argument("--format", choices=head_formats.FORMATS, default="specforge")
    e.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    e.add_argument(
        "--target-layers",
        type=int,
        default=None,
        help="the target's decoder layers, for a checkpoint that names no aux layers (their default depends on it)",
    )
    i = hs.add_parser("info", help="what an EAGLE-3 head directory holds")
    i.add_argument("dir")
    i.add_argument("--target-layers", type=int, default=None)
    r = hs.add_parser("reset", help="drop the heads `serve --learn` adapted: the next start serves the shipped head")
    r.add_argument("--target", default=None, help="only this target's (its name as served; default: every target's)")
    return h


def _read(path: str, target_layers: int | None) -> head_formats.Eagle3Checkpoint:
    from ..models.heads import read_head_config

    cfg = read_head_config(path, expect_type="eagle3")
    n = target_layers or _declared_layers(cfg)
    if n is None:
        raise ConfigError(f"{path} names no aux layers; give --target-layers N (the target's decoder layers)")
    return head_formats.read(path, cfg, n)


def _declared_layers(cfg: dict) -> int | None:
    """A bound on the target's layers that lets a checkpoint's own aux ids pass the range check."""
    meta = cfg.get("specdraft") if isinstance(cfg.get("specdraft"), dict) else {}
    sig = meta.get("target_signature") if isinstance(meta.get("target_signature"), dict) else {}
    if isinstance(sig.get("num_hidden_layers"), int):
        return sig["num_hidden_layers"]
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return max(ids) + 3 if isinstance(ids, list) and ids and all(isinstance(x, int) for x in ids) else None


def main_heads(a) -> int:
    if a.heads_cmd == "reset":
        return _reset(a.target)
    ck = _read(a.src if a.heads_cmd == "export" else a.dir, a.target_layers)
    if a.heads_cmd == "info":
        s = ck.shape
        print(
            json.dumps(
                {
                    "format": ck.format,
                    "hidden_size": s.hidden_size,
                    "intermediate_size": s.intermediate_size,
                    "draft_vocab_size": s.draft_vocab_size,
                    "vocab_size": s.vocab_size,
                    "aux_layers (hidden-states indices)": list(s.layers),
                    "parameters": sum(v.numel() for k, v in ck.state.items() if k not in ("d2t", "t2d")),
                    "target": ck.meta.get("target"),
                },
                indent=1,
            )
        )
        return 0
    out = Path(a.out)
    if out.resolve() == Path(a.src).resolve():
        raise ConfigError("export writes another directory; OUT is SRC")
    meta = {k: v for k, v in ck.meta.items() if k not in ("storage", "aux_layers")} or None
    head_formats.write(out, ck.shape, ck.state, meta, fmt=a.format, dtype=DTYPES[a.dtype])
    print(f"wrote {out} ({a.format}, {a.dtype})", file=sys.stderr)
    return 0


def _reset(target: str | None) -> int:
    from ..learning.store import adapted_root, reset

    gone = reset(target)
    for d in gone:
        print(f"removed {d}", file=sys.stderr)
    whose = f"of {target} " if target else ""
    print(
        f"{len(gone)} adapted head(s) {whose}removed from {adapted_root()}; the shipped heads serve from the next "
        "start (a server running now keeps its adapted head in memory until it stops)",
        file=sys.stderr,
    )
    return 0
