"""``python -m benchmarks SUITE [flags]``: run one suite and write its section of docs/benchmarks.md.

A suite is a module with ``FLAGS`` (name -> default, (default, help) or add_argument's keywords), ``DRY_RUN`` (the
sizes ``--dry-run`` runs it at, against benchmarks/fake.py, writing nothing unless ``--out`` is given) and
``run(args)``, which returns its ``doc.Section``; ``OUT`` and ``HEADER`` where the section goes to another file.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from pathlib import Path
from typing import Any

from benchmarks.doc import HEADER, replace_section

NAMES = "bench peers quality levers kernels neighbour prefix resume tenants structured score startup lora ab soak gpu"
MODULES = {"levers": "cpu_levers", "kernels": "cpu_kernels", "gpu": "gpu_bench"}  # where the names differ
SUITES = {name: f"benchmarks.{MODULES.get(name, name)}" for name in NAMES.split()}
DOC = Path("docs/benchmarks.md")


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def add_flags(parser: argparse.ArgumentParser, flags: dict[str, Any]) -> None:
    """``--name`` for each entry: its type (or action: a bool, a list) from its default."""
    for name, spec in flags.items():
        if not isinstance(spec, dict):
            default, text = spec if isinstance(spec, tuple) else (spec, None)
            spec = {"default": default, "help": text}
            if isinstance(default, bool | list):
                spec["action"] = argparse.BooleanOptionalAction if isinstance(default, bool) else "append"
            elif default is not None:
                spec["type"] = type(default)
        parser.add_argument("--" + name.replace("_", "-"), **spec)


def parser_for(name: str, dry_run: bool = False) -> argparse.ArgumentParser:
    suite = importlib.import_module(SUITES[name])
    parser = argparse.ArgumentParser(f"python -m benchmarks {name}", description=suite.__doc__, formatter_class=_Help)
    parser.add_argument("--model", default="default", help="the model every server and in-process run loads")
    out = None if dry_run else getattr(suite, "OUT", DOC)
    parser.add_argument("--out", type=Path, default=out, help="where the section goes")
    parser.add_argument("--dry-run", action="store_true", help="against fake servers at the smallest sizes")
    add_flags(parser, suite.FLAGS)
    parser.set_defaults(command=f"python -m benchmarks {name}", **(suite.DRY_RUN if dry_run else {}))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("list", "-h", "--help"):
        for name, module in SUITES.items():
            print(f"{name:<11} {(importlib.import_module(module).__doc__ or '').strip().splitlines()[0]}")
        return 0 if argv[:1] == ["list"] else 2
    name, rest = argv[0], argv[1:]
    if name not in SUITES:
        print(f"unknown suite {name!r}; `python -m benchmarks list` names them", file=sys.stderr)
        return 2
    args = parser_for(name, "--dry-run" in rest).parse_args(rest)
    args.command = "python -m benchmarks " + shlex.join([name, *rest])  # as a shell would take it back
    suite = importlib.import_module(SUITES[name])
    section = suite.run(args)
    print(section.text)
    if args.out:
        replace_section(args.out, section.name, section.text, getattr(suite, "HEADER", HEADER))
    return 0 if section.ok else 1


if __name__ == "__main__":
    sys.exit(main())
