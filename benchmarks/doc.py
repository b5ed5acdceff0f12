"""docs/benchmarks.md is written by several benchmarks, each owning one marked section."""

from __future__ import annotations

from pathlib import Path

HEADER = """# Benchmarks

Written by the benchmarks, not by hand: each section below belongs to one command
(`make bench`, `make bench-peers`, `make bench-quality`, `make bench-levers`, `make bench-kernels`, `make bench-neighbour`, `make bench-prefix`, `make bench-resume`,
`make bench-structured`, `make bench-tenants`, `python -m benchmarks.engine_speed --section`), which replaces only its own
section and records its exact invocation. Every figure in a section comes from one run
of that command on one machine; the machine is shared and noisy, so compare the rows
and ratios inside a section, not absolute figures across sections.
"""


def replace_section(path: Path, name: str, text: str) -> None:
    """Put ``text`` between the markers of section ``name`` in ``path``, keeping the rest."""
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    old = path.read_text() if path.exists() else ""
    if not old.startswith(HEADER):
        old = HEADER  # a file from before the sections (or none): start again
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        new = old.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)
