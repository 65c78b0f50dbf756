"""A check for tensors made on torch's default device: what would land on the wrong device once the models run
on a GPU, found on a CPU-only machine.

``ImplicitDevices`` is a TorchFunctionMode (the hook ``torch.set_default_device`` itself uses). While it is
on, it records every call of a factory function (``torch.zeros``, ``tensor``, ``arange``, ``rand``, ...: the
functions the default device redirects) that names no device, made by this project's code. A call counts
as the project's when its nearest caller outside torch is a file outside the installed packages. Factory
calls inside transformers' modeling code do not count: a model's own code places its tensors."""

from __future__ import annotations

import os
import sys
import sysconfig
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

FACTORIES = _device_constructors()
TORCH_DIR = os.path.dirname(torch.__file__)
INSTALLED = tuple({sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")})
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _our_caller() -> str | None:
    """'path:line' of the nearest caller outside torch and this file, when it is the project's code."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.startswith(TORCH_DIR) or f.f_code.co_filename == __file__):
        f = f.f_back
    if f is None:
        return None
    name = os.path.abspath(f.f_code.co_filename)
    if name.startswith(INSTALLED) or not name.startswith(ROOT):
        return None
    return f"{os.path.relpath(name, ROOT)}:{f.f_lineno}"


class ImplicitDevices(TorchFunctionMode):
    """Records, while on, the project's factory calls that name no device (``found``: 'path:line torch.fn' ->
    calls)."""

    def __init__(self):
        super().__init__()
        self.found: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            where = _our_caller()
            if where is not None:
                self.found[f"{where} torch.{func.__name__}"] += 1
        return func(*args, **kwargs)
