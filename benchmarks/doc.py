"""The report writer: docs/benchmarks.md (docs/reliability.md, docs/benchmarks-cuda.md) is written
by the suites, each owning one marked section that says which command wrote it, when, and where."""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from collections.abc import Iterable
from pathlib import Path

HEADER = """# Benchmarks

Written by the benchmarks, not by hand: each section below belongs to one command
(`make bench`, `make bench-peers`, `make bench-quality`, `make bench-levers`, `make bench-kernels`, \
`make bench-neighbour`, `make bench-prefix`, `make bench-resume`,
`make bench-structured`, `make bench-tenants`, `make bench-score`, `make bench-startup`, `make bench-lora`, \
`python -m benchmarks ab --section`), which replaces only its own
section and records its exact invocation. Every figure in a section comes from one run
of that command on one machine; the machine is shared and noisy, so compare the rows
and ratios inside a section, not absolute figures across sections.
"""


@dataclasses.dataclass(frozen=True)
class Section:
    """What a suite's ``run()`` returns: the marked section ``name``; ``ok``: the run passed."""

    name: str
    text: str
    ok: bool = True


def section(name: str, title: str, command: str, *lines: str, ok: bool = True) -> Section:
    """Section ``name``: ``## title``, the line that names ``command``, then ``lines``; ``ok``: the run passed."""
    quoted = f"`` {command} ``" if "`" in command else f"`{command}`"  # a command with a backtick in it
    heading = [f"## {title}", "", f"Written by {quoted} at {now()}; do not edit by hand."]
    return Section(name, "\n".join([*heading, *lines]).rstrip("\n") + "\n", ok)


def table(header: str, align: str, rows: Iterable[Iterable[object]]) -> list[str]:
    """A markdown table: ``header`` ("a | b"), ``align`` (l or r per column), then ``rows`` of cells."""
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align)
    return [f"| {header} |", rule, *(f"| {' | '.join(str(cell) for cell in row)} |" for row in rows)]


def sub(title: str, *lines: str) -> list[str]:
    """A subsection: a blank line, ``### title``, a blank line, then ``lines``."""
    return ["", f"### {title}", "", *lines]


def replace_section(path: Path, name: str, text: str, header: str = HEADER) -> None:
    """Put ``text`` between the markers of section ``name`` in ``path``, keeping the rest."""
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    old = path.read_text() if path.exists() else ""
    if not old.startswith(header):
        # Another header (older, or edited by hand): the header is renewed, every section kept.
        first = old.find("<!-- ")
        old = header + ("\n" + old[first:] if first >= 0 else "")
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        new = old.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def log(message: str) -> None:
    """A suite's progress, on stderr (stdout gets its section)."""
    print(message, file=sys.stderr, flush=True)


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def machine() -> dict[str, str]:
    """The machine a section was measured on: CPU, its instruction sets, cores, GPU, versions."""
    import torch
    import transformers
    from tokenwire_server.model import cpu_instruction_sets, cpu_name

    cpu = cpu_name()
    if cpu == "unknown":  # no model name in /proc/cpuinfo
        cpu = platform.processor() or cpu
    return {"cpu": cpu, "instruction sets": ", ".join(cpu_instruction_sets()) or "none of note",
            "cores": str(os.cpu_count()),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "torch threads": str(torch.get_num_threads())}  # fmt: skip


def host() -> str:
    """The machine in one phrase, for a section's opening sentence."""
    m = machine()
    return f"{m['cpu']} ({m['instruction sets']}), {m['cores']} cores, torch {m['torch']}"
