"""The adapted head, kept per target and shipped head: ``$SPECDRAFT_HOME/adapted/<target>-<hash>/``, where
<hash> is the start of the SHA-256 of the shipped head's files (another head, or a retrained one, starts
over) and <target> the target's name as loaded.

Inside, each kept update is a head directory ``versions/NNNNNN/`` (the reference layout,
models/head_formats.py: it loads with ``--head`` like any head) and ``current`` is a symbolic link to the
newest. A version is written under a temporary name, its files flushed to disk, then renamed whole into
``versions/``; only then is a new link made beside ``current`` and renamed over it. Each rename is
atomic, so a crash at any point leaves ``current`` naming a complete version (or nothing: the shipped
head), never half of one. The two newest versions are kept."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch

from ..core.errors import ConfigError
from ..drafters.arms import slug

ADAPTED = "adapted"
POINTER = "current"
VERSIONS = "versions"
PARTIAL = ".partial-"
KEEP_VERSIONS = 2
STALE_PARTIAL_S = 600.0  # a partial version this old belongs to a writer that is gone
HEAD_FILES = ("config.json", "model.safetensors", "pytorch_model.bin")  # what a head directory is read from


def adapted_root(home: Path | None = None) -> Path:
    from ..models.catalog import home as models_home

    return Path(home or models_home()) / ADAPTED


def head_fingerprint(head_dir: str | Path) -> str:
    """SHA-256 of the head directory's files that make the head."""
    h = hashlib.sha256()
    for name in HEAD_FILES:
        f = Path(head_dir) / name
        if f.is_file():
            h.update(name.encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


def store_name(target_name: str, fingerprint: str) -> str:
    return f"{slug(target_name)}-{fingerprint[:16]}"


class AdaptedStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    @property
    def versions(self) -> Path:
        return self.root / VERSIONS

    def current(self) -> Path | None:
        """The newest complete version, or None (nothing kept yet)."""
        link = self.root / POINTER
        if not link.is_symlink():
            return None
        path = (self.root / os.readlink(link)).resolve()
        if path.parent != self.versions.resolve() or not path.is_dir():
            raise ConfigError(
                f"the adapted head's pointer {link} names {path}, not a version of {self.versions}; "
                "`specdraft heads reset` returns to the shipped head"
            )
        return path

    def load(self, target_layers: int):
        """The current version as a ``head_formats.Eagle3Checkpoint`` (None when there is none)."""
        from ..models.head_formats import read

        path = self.current()
        if path is None:
            return None
        try:
            cfg = json.loads((path / "config.json").read_text())
            return read(path, cfg, target_layers)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"the adapted head {path} cannot be read ({e}); `specdraft heads reset` returns to the shipped head"
            ) from None

    def save(self, shape, state: dict, meta: dict, dtype: torch.dtype) -> Path:
        """A new version of ``state`` (the head's tensors), then ``current`` moved to it (module doc)."""
        from ..models.head_formats import write

        self.versions.mkdir(parents=True, exist_ok=True)
        while True:
            v = self._next_version()
            tmp = self.versions / f"{PARTIAL}{v:06d}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            write(tmp, shape, state, {**meta, "version": v}, dtype=dtype)
            _flush(tmp)
            try:
                os.rename(tmp, self.versions / f"{v:06d}")  # fails if another writer took v: take the next
                break
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
        _fsync_dir(self.versions)
        self._point_to(f"{VERSIONS}/{v:06d}")
        self._prune()
        return self.versions / f"{v:06d}"

    def _point_to(self, rel: str) -> None:
        link = self.root / f"{POINTER}.tmp-{os.getpid()}"
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(rel, link)
        os.replace(link, self.root / POINTER)
        _fsync_dir(self.root)

    def _numbered(self) -> list[int]:
        if not self.versions.is_dir():
            return []
        return sorted(int(p.name) for p in self.versions.iterdir() if p.name.isdigit())

    def _next_version(self) -> int:
        have = self._numbered()
        return (have[-1] if have else 0) + 1

    def _prune(self) -> None:
        current = self.current()
        for v in self._numbered()[:-KEEP_VERSIONS]:
            p = self.versions / f"{v:06d}"
            if p != current:
                shutil.rmtree(p, ignore_errors=True)
        for p in self.versions.glob(PARTIAL + "*"):
            try:
                if time.time() - p.stat().st_mtime > STALE_PARTIAL_S:
                    shutil.rmtree(p, ignore_errors=True)
            except OSError:
                pass


def _flush(folder: Path) -> None:
    """Every file of ``folder`` and the folder itself on disk (a power cut after the rename finds them)."""
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def reset(target: str | None = None, home: Path | None = None) -> list[Path]:
    """Removes the adapted heads (of ``target``'s name, or all); -> the directories removed."""
    root = adapted_root(home)
    if not root.is_dir():
        return []
    prefix = None if target is None else slug(target) + "-"
    gone = []
    for d in sorted(root.iterdir()):
        if d.is_dir() and (prefix is None or (d.name.startswith(prefix) and len(d.name) == len(prefix) + 16)):
            shutil.rmtree(d)
            gone.append(d)
    return gone
