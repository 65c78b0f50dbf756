"""The operator's resources: the files a request's spec may name, by name only (``serve --resource
FIELD:NAME=PATH``; server/protocol.py resolves the names). ``serve`` checks every one at start; a request's
are checked again and loaded before it is admitted, in a thread of their own, within a time limit that the
request's timeout and shutdown reach; an autotune file's with what its arms read. The decoder keeps what
was loaded, and admission (on the worker thread, unbounded) reads only that, never a file: one swapped for
a FIFO meanwhile would block the worker. A client is told which resource failed, never its path (the
reason goes to the server's log): paths say how the operator's machine is laid out."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading

from ..core.config import PATH_FIELDS
from ..core.errors import SpecDraftError
from ..core.methods import method as registered
from .protocol import RequestError
from .scheduler import shutdown_error

log = logging.getLogger("specdraft.server")

# field: the files a loader reads, relative to the path ("" is the path itself, a file); a directory otherwise.
# A tuple in the list: the loader reads the first of these that exists (a head's weights: ours, or an
# EAGLE-3 checkpoint's).
FILES = {
    "skip_config": ("",),
    "autotune": ("",),
    "datastore": ("meta.json", "tokens.npy", "sa.npy"),
    "head": ("config.json", ("head.safetensors", "model.safetensors", "pytorch_model.bin")),
}
MAX_JSON_BYTES = 1 << 20  # a JSON file (skip config, autotune file, a manifest) larger than this is refused unread
LOAD_S = 60.0  # the longest one request's resources may take to load (less with a shorter --timeout)


def problem(field: str, path: str) -> str | None:
    """Why ``path`` cannot be a ``field`` resource, or None: it must exist as a directory or regular file, as
    the field reads it, with the files its loader opens regular (a FIFO or device would block the reader) and
    its JSON under MAX_JSON_BYTES. Only stat()ed: nothing is opened."""
    files = FILES[field]
    if files != ("",):
        try:
            if not stat.S_ISDIR(os.stat(path).st_mode):
                return "not a directory"
        except OSError as e:
            return e.strerror.lower()
    for name in files:
        if isinstance(name, tuple):  # alternatives: the first that exists
            name = next((n for n in name if os.path.lexists(os.path.join(path, n))), name[0])
        f = os.path.join(path, name) if name else path
        where = f"{name}: " if name else ""
        try:
            st = os.stat(f)
        except OSError as e:
            return where + e.strerror.lower()
        if not stat.S_ISREG(st.st_mode):
            return where + "not a regular file"
        if (f.endswith(".json") or field in ("skip_config", "autotune")) and st.st_size > MAX_JSON_BYTES:
            return f"{where}{st.st_size} bytes, over the {MAX_JSON_BYTES}-byte limit of a JSON file"
    return None


def check_all(resources: dict[str, dict[str, str]]) -> None:
    """``serve``'s start: a SpecDraftError naming the first resource that is not what its field reads."""
    for field, table in resources.items():
        for name, path in table.items():
            why = problem(field, path)
            if why:
                raise SpecDraftError(f"--resource {field}:{name}={path}: {why}")


LOADERS = {
    "head": lambda dec, spec: dec.head(spec),
    "datastore": lambda dec, spec: dec.datastore(spec.get("datastore")),
    "skip_config": lambda dec, spec: dec.skip_config(spec.get("skip_config")),
    "autotune": lambda dec, spec: _arms_resources(dec, spec.get("autotune")),
}


def _read(decoder, spec, fields: list[str], on_field=lambda field: None) -> None:
    """Loads (into the decoder's caches) what ``spec`` reads: each of ``fields`` (``on_field`` told which one
    is loading), then its method's resource (a layer view of this target, a head of the method's type)."""
    for field in fields:
        on_field(field)
        LOADERS[field](decoder, spec)
    on_field(None)
    registered(spec.method).resource(decoder, spec)


def _arms_resources(decoder, path: str) -> None:
    """The autotune file at ``path`` and what each of its arms reads (a datastore, a head, a skip config):
    checked as the operator's own resources are and loaded, so that admission makes the arms from the
    decoder's caches and a client never hears an arm's path."""
    from ..drafters.arms import file_arms

    for name, arm, _ in file_arms(decoder, path):
        fields = [field for field, _ in used(arm, {})]
        for field in fields:
            why = problem(field, arm.get(field))
            if why:
                raise SpecDraftError(f"arm {name!r}: {field} {arm.get(field)}: {why}")
        _read(decoder, arm, fields)


def used(spec, named: dict) -> list[tuple[str, str]]:
    """(field, how errors call it) of each file ``spec`` reads: the resource a request named, else the
    server's own (its --config or flags)."""
    out = []
    for field in PATH_FIELDS:
        v = spec.get(field)
        if v is not None and not (field == "autotune" and v == "off"):
            out.append((field, f"resource {named[field]!r}" if field in named else f"the server's {field}"))
    return out


async def load(decoder, spec, named: dict, limit_s: float, draining) -> None:
    """Checks and loads what ``spec`` reads (cached by the decoder), then its method's ``load_resource``; a
    RequestError naming the field: 400 when a resource is not available, 408 past ``limit_s``, 503 once
    ``draining()``."""
    fields = used(spec, named)
    for field, what in fields:
        why = problem(field, spec.get(field))
        if why:
            raise _unavailable(field, what, spec, why)
    at = {"field": None}

    def work():
        _read(decoder, spec, [field for field, _ in fields], lambda field: at.update(field=field))

    try:
        await _bounded(work, limit_s, draining)
    except RequestError:  # shutting down
        raise
    except TimeoutError:
        field = at["field"]
        what = dict(fields)[field] if field else "the method's resource"
        raise RequestError(
            f"spec{'.' + field if field else ''}: {what} did not load within {limit_s:g} s",
            param=f"spec.{field}" if field else "spec",
            status=408,
            type="timeout_error",
            code="request_timeout",
        ) from None
    except Exception as e:
        if at["field"] is not None:  # reading an operator's file (a corrupt one fails in numpy, safetensors...)
            raise _unavailable(at["field"], dict(fields)[at["field"]], spec, e) from None
        if isinstance(e, SpecDraftError):  # the method's own check (exit_layer past the target's layers)
            raise RequestError(f"spec: {e}", param="spec") from None
        raise


def _unavailable(field: str, what: str, spec, why) -> RequestError:
    """The client's error names the resource; the server's log says where it is and what is wrong with it."""
    log.warning("spec.%s: %s at %s is not available: %s", field, what, spec.get(field), why)
    return RequestError(f"spec.{field}: {what} is not available", param=f"spec.{field}")


async def _bounded(fn, limit_s: float, draining):
    """``fn()`` in a daemon thread (one that blocks forever neither holds the event loop nor keeps the process
    alive at exit); TimeoutError past ``limit_s``, the shutdown error once ``draining()``."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(out):
        if not done.done():
            done.set_result(out)

    def run():
        try:
            out = (fn(), None)
        except BaseException as e:  # handed to the request; a bug is its 500
            out = (None, e)
        try:
            loop.call_soon_threadsafe(settle, out)
        except RuntimeError:  # the loop closed meanwhile: nobody waits
            pass

    threading.Thread(target=run, name="resource-load", daemon=True).start()
    end = loop.time() + limit_s
    while not done.done():
        if draining():
            raise shutdown_error()
        if loop.time() >= end:
            raise TimeoutError
        await asyncio.wait({done}, timeout=min(0.25, end - loop.time()))
    value, err = done.result()
    if err is not None:
        raise err
    return value
