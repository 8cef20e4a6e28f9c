"""Host-made tensors onto the device without waiting for it.

A forward's small tensors (token ids, positions, KV slots, masks) are made on the host. torch copies
a tensor from pageable host memory to a GPU synchronously: ``torch.tensor(..., device="cuda")``
and ``.to("cuda")`` wait for every kernel queued before the copy, so each forward's copies would
hold the host until the previous forward finished, and a draft step's launches could not run
ahead of its kernels. These copy through pinned memory without waiting (torch's pinned-memory
allocator keeps a block until its copy is done). On a CPU the tensors stay as they are.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (made on the host) on ``device``, copied without waiting on a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return t if t.device == device else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tensor(data: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:  # noqa: ANN401
    """``torch.tensor(data, dtype=dtype)`` on ``device`` (see ``to_device``)."""
    return to_device(torch.tensor(data, dtype=dtype), device)


def copy_into(dest: torch.Tensor, src: torch.Tensor) -> None:
    """Fill ``dest`` from the host-made ``src`` (see ``to_device``)."""
    if dest.device.type == "cuda":
        dest.copy_(src.pin_memory(), non_blocking=True)
    else:
        dest.copy_(src)
