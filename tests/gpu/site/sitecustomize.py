"""Loaded by Python at start-up in a server that a GPU test starts with this folder first on
PYTHONPATH (``tests/gpu/test_gpu.py``): what only the device can do to a process, done to
the real server without a hook in its code.

- ``TOKENWIRE_TEST_MEMORY_CAP_GIB``: ``torch.cuda.set_per_process_memory_fraction`` to that
  many GiB before anything is allocated: a smaller card on a larger one.
- ``TOKENWIRE_TEST_DEVICE_ASSERT_FILE``: once that file exists, the engine's next step
  indexes out of bounds on the device first: a real device-side assert, which leaves the
  CUDA context faulted for good (a sticky fault).
"""

from __future__ import annotations

import os

_cap = os.environ.get("TOKENWIRE_TEST_MEMORY_CAP_GIB")
_trigger = os.environ.get("TOKENWIRE_TEST_DEVICE_ASSERT_FILE")

if _cap:
    import torch

    _total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, float(_cap) * 2**30 / _total), 0)

if _trigger:
    from typing import Any

    import torch
    from tokenwire_server.engine import runner as _runner

    # ``launch``: what both loops call (the plain loop's ``run`` is launch + collect; the
    # overlapped loop, CUDA's default, calls launch and collect itself).
    _launch = _runner.ModelRunner.launch

    def _faulting(self: Any, plan: Any) -> Any:
        if os.path.exists(_trigger):
            x = torch.zeros(4, device=self.loaded.device)
            x[torch.tensor([1 << 20], device=x.device)] = 1.0  # out of bounds: a device-side assert
            torch.cuda.synchronize(x.device)
        return _launch(self, plan)

    _runner.ModelRunner.launch = _faulting  # type: ignore[method-assign]
