"""The optional dependencies, by the pip extra of specdraft that installs them (pyproject.toml's
``[project.optional-dependencies]``), and the one line a backend or a command says when one is missing:
``the llama backend needs llama-cpp-python (pip install 'specdraft[llama]')``."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Extra:
    packages: str  # what the user is told is missing
    modules: tuple[str, ...]  # what imports once the extra is installed
    checkout: str  # how a source checkout's Makefile installs it instead


EXTRAS = {
    "llama": Extra("llama-cpp-python", ("llama_cpp",), "`make setup` builds it for this CPU"),
    "openvino": Extra(
        "openvino, openvino-genai and openvino-tokenizers", ("openvino", "openvino_genai"), "`make setup` installs them"
    ),
    "server": Extra(
        "fastapi, uvicorn, httpx and prometheus_client",
        ("fastapi", "uvicorn", "httpx", "prometheus_client"),
        "`make setup` installs them",
    ),
    "ray": Extra("Ray", ("ray",), "`make setup-ray`"),
    "leak": Extra(
        "scikit-learn and the server packages", ("sklearn", "fastapi", "uvicorn", "httpx"), "`make setup` installs them"
    ),
}


def needs_extra(what: str, extra: str, error: ImportError | None = None) -> str:
    """One line: ``what`` needs the extra's packages, how to install them, and the import error when it is
    more than the package's absence (a package that is there but does not load: its shared library...)."""
    e = EXTRAS[extra]
    line = f"{what} needs {e.packages} (pip install 'specdraft[{extra}]'; in a checkout, {e.checkout})"
    absent = isinstance(error, ModuleNotFoundError) and error.name in e.modules
    return line if error is None or absent else f"{line}: {error}"


def require_module(module: str, extra: str, what: str):
    """The module, imported; a ConfigError of ``needs_extra`` when it does not import."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(needs_extra(what, extra, err)) from err


def require_extra(extra: str, what: str) -> None:
    """Every module of the extra imports, or a ConfigError of ``needs_extra`` before any work starts."""
    for module in EXTRAS[extra].modules:
        require_module(module, extra, what)
