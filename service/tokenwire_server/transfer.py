"""Host values to the step's device without waiting for the device.

A plain host -> CUDA copy (``tensor.to("cuda")``, ``torch.tensor(values, device="cuda")``)
is made from pageable memory, and torch's ``copy_`` then synchronises the stream: the host
waits for everything already queued there. Made after a step's forward pass has been queued
(the rows whose logits are kept, the sampler's temperatures, seeds, penalties and top-k/top-p,
a grammar's token mask), it makes the host wait for the whole forward pass, which is the
wait ``--overlap`` exists to hide. Here such values go through pinned memory (torch's caching
host allocator: the block is not reused before its copy is done) and one ``non_blocking``
copy, queued in stream order like the kernels that read it.

On other devices (the CPU, ``meta``) a value is made where it is used, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

PINNED_DEVICE_TYPES = frozenset({"cuda"})  # the device types whose host copies go through pinned memory


def pinned(device: torch.device) -> bool:
    """Whether host values bound for ``device`` are staged in pinned memory (also the decode
    graphs' input buffer, engine/graphs.py)."""
    return device.type in PINNED_DEVICE_TYPES


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``; on CUDA a queued copy the host does not wait for."""
    if not pinned(device) or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def host_tensor(values: Sequence[object], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device`` (see ``to_device``)."""
    if not pinned(device):
        return torch.tensor(values, dtype=dtype, device=device)
    return to_device(torch.tensor(values, dtype=dtype), device)
