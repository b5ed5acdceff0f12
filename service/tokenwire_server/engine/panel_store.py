"""The native pass's GEMM panels, kept in the model cache from one start to the next.

Laying the weights out as the compiled ``panel_linear`` reads them (``native.Linear``) is a
transposing copy of every GEMM's weights into memory touched for the first time: most of a
CPU start's engine phase (~0.2 s of ~0.4 s for the default model's float32 panels on a 2-core
Intel host, docs/benchmarks.md, "Start-up"). The first start keeps what it laid out beside the
converted weights (``checkpoint._converted_path``, "packed"); a later one maps the file, as it
maps the checkpoint, and reads no weight it would only have copied.

A kept file is used only where it is the same layout of the same weights: its name carries the
weights' dtype, the panels' width (``PANEL``) and ``LAYOUT``, which changes with the layout's
code; it must be newer than the weights' files; and each panel must have the shape and dtype the
layer's layout gives it (bf16 pairs or not, which ``native.Linear`` decides, differ in shape),
else that layer is laid out again and the file written afresh.
The file is written in the safetensors format from the panels' own memory
(``checkpoint.write_safetensors``), under a temporary name, then renamed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import write_safetensors

log = logging.getLogger("tokenwire.engine")

# The layout's version: bump when ``native.Linear`` lays panels out otherwise.
LAYOUT = 1


class PanelStore:
    """Panels by layer name: the kept file's, mapped (``take``), and those laid out at this start
    (``keep``), written once every layer has been laid out (``save``)."""

    def __init__(self, path: Path | None, newer_than: float = 0.0) -> None:
        self.path = path
        self._found: dict[str, torch.Tensor] = {}
        self._layers: dict[str, torch.Tensor] = {}  # every layer's panels at this start, kept or laid out
        self._made = 0  # of them laid out here: the file is written afresh, all of them
        self.mapped = 0  # of them taken from the kept file
        if path is None or not path.is_file() or path.stat().st_mtime < newer_than:
            return
        try:
            from safetensors import safe_open

            with safe_open(str(path), "pt") as handle:
                if (handle.metadata() or {}).get("layout") != str(LAYOUT):
                    return
                self._found = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        except Exception as exc:  # a torn or foreign file: lay the panels out again
            log.warning(
                "kept GEMM panels unreadable; laying them out again", extra={"path": str(path), "error": str(exc)}
            )
            self._found = {}

    @classmethod
    def for_model(cls, model: Any, panel: int) -> PanelStore:
        """The store for ``model``'s panels (nothing kept where its loader named no place)."""
        stem: Path | None = getattr(model, "packed_stem", None)
        if stem is None:
            return cls(None)
        path = stem.with_name(f"{stem.name}.panels{panel}.v{LAYOUT}.safetensors")
        return cls(path, float(getattr(model, "weights_mtime", 0.0)))

    def take(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        """The kept panels of layer ``name``, where they have its ``shape`` and ``dtype``."""
        found = self._found.get(name)
        if found is None or found.shape != shape or found.dtype != dtype:
            return None
        self._layers[name] = found
        self.mapped += 1
        return found

    def keep(self, name: str, panels: torch.Tensor) -> None:
        """Layer ``name``'s panels, laid out at this start."""
        self._layers[name] = panels
        self._made += 1

    def save(self) -> None:
        """Write every layer's panels where some were laid out at this start and there is a place."""
        if self.path is None or not self._made:
            return
        scratch = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors(scratch, self._layers, {"layout": str(LAYOUT)})
            scratch.replace(self.path)  # atomic: a server starting beside this one maps all of it or none
            log.info("kept the GEMM panels", extra={"path": str(self.path), "layers": len(self._layers)})
        except OSError as exc:  # a full or read-only cache: lay them out again next time
            log.warning("could not keep the GEMM panels", extra={"path": str(self.path), "error": str(exc)})
            scratch.unlink(missing_ok=True)
        self._made = 0
