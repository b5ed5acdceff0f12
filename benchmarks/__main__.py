"""``python -m benchmarks SUITE [flags]``: run one suite and write its section of
docs/benchmarks.md; ``python -m benchmarks list`` names them.

A suite is a module with its own flags (``add_arguments``), a ``run(args)`` that returns its
``doc.Section``, and the sizes ``--dry-run`` runs it at (``DRY_RUN``). Every suite takes
``--out`` (the file its section goes to) and ``--dry-run``: the same code against the fake
servers of benchmarks/fake.py, at the smallest sizes, writing nothing unless ``--out`` is
given.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

from benchmarks.doc import replace_section

SUITES = {
    "bench": "benchmarks.bench",
    "peers": "benchmarks.peers",
    "quality": "benchmarks.quality",
    "levers": "benchmarks.cpu_levers",
    "kernels": "benchmarks.cpu_kernels",
    "neighbour": "benchmarks.neighbour",
    "prefix": "benchmarks.prefix",
    "resume": "benchmarks.resume",
    "tenants": "benchmarks.tenants",
    "structured": "benchmarks.structured",
    "startup": "benchmarks.startup",
    "ab": "benchmarks.ab",
}
DOC = Path("docs/benchmarks.md")


def parser_for(name: str, suite: ModuleType, dry_run: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks {name}",
        description=suite.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="default", help="the model every server and in-process run loads")
    parser.add_argument("--out", type=Path, default=None if dry_run else DOC, help=f"where the section goes ({DOC})")
    parser.add_argument("--dry-run", action="store_true", help="against fake servers at the smallest sizes")
    suite.add_arguments(parser)
    if dry_run:
        parser.set_defaults(**suite.DRY_RUN)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("list", "-h", "--help"):
        for name, module in SUITES.items():
            doc = importlib.import_module(module).__doc__ or ""
            print(f"{name:<11} {doc.strip().splitlines()[0]}")
        return 0 if argv[:1] == ["list"] else 2
    name, rest = argv[0], argv[1:]
    if name not in SUITES:
        print(f"unknown suite {name!r}; `python -m benchmarks list` names them", file=sys.stderr)
        return 2
    suite = importlib.import_module(SUITES[name])
    args = parser_for(name, suite, "--dry-run" in rest).parse_args(rest)
    args.command = " ".join(["python -m benchmarks", name, *rest])
    section = suite.run(args)
    print(section.text)
    if args.out:
        replace_section(args.out, section.name, section.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
