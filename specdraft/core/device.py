"""Where tensors live, and the device setting (library ``device=``, the CLI's ``--device``).

``HOST`` holds the loop's bookkeeping: a draft's tokens and parents, the masks and positions built for a
forward, a cache's validity bits, the tokens fed. These are small tensors built from Python lists and read
back as lists. A model's logits and features live on its ``device`` (models/base.py); verification, logits
processing and each request's random stream run there. Every tensor on the step path names its device, so
nothing depends on torch's default device (tests/test_device.py checks this).

The setting is one word. ``auto`` means CUDA when torch sees a GPU, else the CPU. ``cpu``, ``cuda`` and
``cuda:N`` are explicit. ``gpu`` is OpenVINO's GPU device (Intel GPUs). Each backend says which kinds it
takes (models/backends.py). ``torch_device`` resolves a setting for torch: the transformers backend, the
heads and their training.
"""

from __future__ import annotations

import torch

from .errors import ConfigError

HOST = torch.device("cpu")
AUTO = "auto"
TORCH_CHOICES = "cpu, cuda, cuda:N or auto"  # what torch runs on (the transformers backend, heads, training)
CHOICES = f"{TORCH_CHOICES} (or gpu: OpenVINO's, for Intel GPUs)"


def device_kind(name: str, flag: str = "--device") -> str:
    """The kind of a device setting: "auto", "cpu", "cuda" (also for cuda:N) or "gpu". A ConfigError
    names ``flag`` when the word is none of those."""
    if name in (AUTO, "gpu"):
        return name
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index):
        raise ConfigError(f"{flag} must be {CHOICES}, got {name!r}")
    return device.type


def cuda_count() -> int:
    """The CUDA devices torch sees here (0 without a CUDA build of torch or without a GPU)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def wait(device: torch.device) -> None:
    """Until ``device`` has done what was queued on it (CUDA runs asynchronously): before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def torch_device(name: str, flag: str = "--device") -> torch.device:
    """A device setting resolved for torch. ``auto`` gives CUDA when torch sees a GPU, else the CPU.
    ``cuda`` or ``cuda:N`` must be a device torch sees here; if it is not, the ConfigError names
    ``flag``."""
    kind = device_kind(name, flag)
    if kind == AUTO:
        return torch.device("cuda" if cuda_count() else "cpu")
    if kind == "gpu":
        raise ConfigError(
            f"{flag} must be {TORCH_CHOICES} here, got 'gpu' (OpenVINO's Intel GPU device: --backend openvino)"
        )
    device = torch.device(name)
    if kind == "cuda" and (device.index or 0) >= cuda_count():
        raise ConfigError(
            f"{flag} {name}: torch sees no such CUDA device here ({cuda_count()} visible); use {flag} cpu (or auto)"
        )
    return device
