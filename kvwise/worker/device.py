"""Where the weights and the KV pool live: ``ModelConfig.device`` made a ``torch.device``.

kvwise runs on the CPU, where its C++ kernels are registered (the ``CPU`` dispatch key).
Another device takes the same model and pool through torch alone: the weights float
(``quantization`` "none": the quantized formats are the CPU kernels'), the pool in a format
without host-only state, the plain-torch attention (``attention.TorchSDPAAttention``), each
step's tables moved there once, the logits brought back to the host to sample, and the tiers'
reads and writes staged through host buffers (``ModelRunner.reads_in_place`` is False). The
"meta" device builds all of it with no memory and no arithmetic: the tests' way to show that no
CPU-only path is touched.
"""

from __future__ import annotations

import torch

HOST = torch.device("cpu")


def resolve_device(name: str | torch.device | None) -> torch.device:
    """``name`` as a device torch can place tensors on here.

    Raises:
        ValueError: naming ``device``, for a name torch does not know or a device this machine
            does not have (e.g. "cuda" without a GPU).
    """
    if name is None:
        return HOST
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {name!r} is not a device torch knows ({exc})") from None
    if device.type == "cpu":
        return HOST
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:  # e.g. torch not built with CUDA
        raise ValueError(f"device: {name!r} is not available on this machine ({exc})") from None
    return device


def is_host(device: torch.device) -> bool:
    """The device is the host's memory (the CPU): kernels, in-place tier reads."""
    return device.type == "cpu"
