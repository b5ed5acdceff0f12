"""What a failed engine step means: which errors end the process, which end only some rows.

- ``out_of_memory``: ``torch.OutOfMemoryError`` (CUDA's, or another accelerator's), and an
  accelerator error that is an allocation failure in another library's words: CUDA's
  "out of memory" (``cudaErrorMemoryAllocation``, a graph that could not be instantiated
  for want of memory), ``CUBLAS_STATUS_ALLOC_FAILED``, ``CUDNN_STATUS_ALLOC_FAILED``. The
  device is fine; this step asked for too much. The engine fails the rows admitted last,
  newest first, and runs the step again without them until it fits (``BatchedEngine``).
- ``device``: any other accelerator error (``torch.AcceleratorError``; on a torch without
  it, a ``RuntimeError`` whose message is a CUDA, cuBLAS, cuDNN or NCCL error). A CUDA
  context that has faulted stays faulted: every later kernel fails too. The engine stops
  taking work, ends every stream and waiting request with INTERNAL naming the fault, and
  liveness turns NOT_SERVING, so Kubernetes restarts the pod.
- ``step``: anything else (a bug in a step). That step's rows fail with INTERNAL and the
  engine goes on; ``FAILED_STEPS_FAULT`` steps in a row failing with no step between that
  worked is treated as a device fault too: the engine cannot do its work, and a restart is
  what an operator would do.

The classification reads only the exception, so a fault can be faked on a CPU in tests.
"""

from __future__ import annotations

import enum

import torch

FAILED_STEPS_FAULT = 3

# Messages of accelerator errors raised as a plain RuntimeError (torch before AcceleratorError).
_DEVICE_MARKERS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "cuDNN error", "NCCL error", "device-side assert")


class Fault(str, enum.Enum):
    OUT_OF_MEMORY = "out_of_memory"
    DEVICE = "device"
    STEP = "step"


# An accelerator error whose message says an allocation failed: the context is not faulted.
_ALLOCATION_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def classify(exc: BaseException) -> Fault:
    if isinstance(exc, torch.OutOfMemoryError):
        return Fault.OUT_OF_MEMORY
    if isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _ALLOCATION_MARKERS):
        return Fault.OUT_OF_MEMORY  # torch.AcceleratorError is a RuntimeError too
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return Fault.DEVICE
    if isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _DEVICE_MARKERS):
        return Fault.DEVICE
    return Fault.STEP


def describe(exc: BaseException) -> str:
    """One line for logs and statuses: the error's type and the first line of its message."""
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message.splitlines()[0]}" if message else type(exc).__name__
