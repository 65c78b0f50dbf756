"""Where a method runs: its table entry's ``runs_on`` (core/methods.py) against what each backend offers
(models/backends.py ``BACKENDS``), and the draft model it may need."""

from __future__ import annotations

from ..core.methods import REGISTRY, Method


def backends(m: Method) -> tuple[str, ...]:
    """The backends ``m`` runs on, read off the backend table now (a backend's entry says what it offers)."""
    from ..models.backends import offering

    return offering(m.runs_on)


def methods_on(backend: str) -> tuple[str, ...]:
    return tuple(m.name for m in REGISTRY.values() if backend in backends(m))


def unavailable(
    m: Method, backend: str, has_draft: bool, subject: str = "method", where: str = "", no_draft: str | None = None
) -> str | None:
    """Why ``m`` cannot run on a decoder of ``backend`` with (or without) a draft model, or None. The caller
    words it: ``subject`` and ``where`` frame the backend message, ``no_draft`` replaces the draft one."""
    if backend not in backends(m):
        return (
            f"{subject} {m.name!r} is not available on the {backend} backend{where}; methods there: "
            f"{', '.join(methods_on(backend))}"
        )
    if m.needs == "draft_model" and not has_draft:
        return no_draft or f"{subject} {m.name!r} needs a draft model (pass draft=NAME / --draft NAME)"
    return None
