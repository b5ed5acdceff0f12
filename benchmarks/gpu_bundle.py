"""The bundle a bare GPU machine needs for ``benchmarks/gpu-check.sh``, packed and checked (``make gpu-wheels``).

A lent GPU machine has torch and transformers but no network and no default model: ``wheels/`` (benchmarks/
gpu-wheels.txt for its Python, ``LIMIT_MIB`` in all) and ``tokenizer/`` travel with the repository. ``check``
needs only the standard library.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WANTED = HERE / "gpu-wheels.txt"
LIMIT_MIB = 60
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
REQUIRED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def wanted(path: Path = WANTED) -> dict[str, str]:
    """``name -> version`` of every ``name==version`` line (names normalised as in wheel files)."""
    out: dict[str, str] = {}
    for line in filter(None, (raw.split("#", 1)[0].strip() for raw in path.read_text().splitlines())):
        name, sep, version = line.partition("==")
        if not sep:
            raise ValueError(f"{path}: {line!r} is not pinned (name==version)")
        out[normalise(name)] = version.strip()
    return out


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_tags(filename: str) -> tuple[str, str, str, str]:
    """(name, version, python tags, abi tags) of a wheel's file name."""
    parts = filename[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        raise ValueError(f"{filename}: not a wheel file name")
    return normalise(parts[0]), parts[1], parts[-3], parts[-2]


def installable(python_tags: str, abi_tags: str, python: str) -> bool:
    """Whether a wheel with these tags installs on CPython ``python`` ("3.12")."""
    major, minor = python.split(".")[:2]
    cp = f"cp{major}{minor}"
    for tag in python_tags.split("."):
        if tag in (f"py{major}", f"py{major}{minor}") and abi_tags == "none":
            return True
        if tag == cp and abi_tags.split(".")[0] in (cp, "abi3", "none"):
            return True
        if abi_tags == "abi3" and tag.startswith(f"cp{major}") and int(tag[3:] or 0) <= int(minor):
            return True
    return False


def check(bundle: Path, python: str, limit_mib: int = LIMIT_MIB, wanted_path: Path = WANTED) -> list[str]:
    """What is wrong with ``bundle`` for CPython ``python``; empty when it is ready."""
    problems: list[str] = []
    wheels_dir = bundle / "wheels"
    found: dict[str, list[tuple[str, str, bool]]] = {}
    total = 0
    for wheel in sorted(wheels_dir.glob("*.whl")) if wheels_dir.is_dir() else []:
        total += wheel.stat().st_size
        try:
            name, version, python_tags, abi_tags = wheel_tags(wheel.name)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        found.setdefault(name, []).append((version, wheel.name, installable(python_tags, abi_tags, python)))
    for name, version in wanted(wanted_path).items():
        have = found.pop(name, [])
        if not have:
            problems.append(f"{name}=={version}: no wheel in {wheels_dir} (make gpu-wheels GPU_PYTHON={python})")
            continue
        if len(have) > 1:
            problems.append(f"{name}: {len(have)} wheels ({', '.join(w for _, w, _ in have)}); keep one")
        got, filename, ok = have[0]
        if got != version:
            problems.append(f"{name}: {filename} is {got}, gpu-wheels.txt pins {version}")
        if not ok:
            problems.append(f"{name}: {filename} does not install on CPython {python}")
    for name, have in sorted(found.items()):
        problems.append(f"{name}: {have[0][1]} is not in gpu-wheels.txt")
    if total > limit_mib * 2**20:
        problems.append(f"the wheels take {total / 2**20:.1f} MiB, over the {limit_mib} MiB they may take")
    tokenizer = bundle / "tokenizer"
    for name in REQUIRED_TOKENIZER_FILES:
        if not (tokenizer / name).is_file():
            problems.append(f"{tokenizer / name}: missing (make gpu-wheels copies the default model's tokenizer)")
    return problems


def load_tokenizer(folder: Path) -> str | None:
    """Load the tokenizer where transformers is importable; a problem, or None."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        if not tokenizer("Hello")["input_ids"]:
            return f"{folder}: the tokenizer gives no ids"
    except Exception as exc:  # what the machine would meet there
        return f"{folder}: the tokenizer does not load: {exc}"
    return None


def pack(bundle: Path, source: Path | None = None) -> None:
    """Copy the default model's tokenizer files into ``bundle/tokenizer``."""
    if source is None:
        from tokenwire_server.model import prepare_default_model

        source = prepare_default_model()
    target = bundle / "tokenizer"
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)


def size_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser("python -m benchmarks.gpu_bundle", description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    packing = sub.add_parser("pack", help="copy the default model's tokenizer files into BUNDLE/tokenizer")
    checking = sub.add_parser("check", help="is BUNDLE ready for a machine with this Python?")
    for command in (packing, checking):
        command.add_argument("bundle", type=Path)
    packing.add_argument("--tokenizer-from", type=Path, help="a model folder (default: the converted default model)")
    checking.add_argument("--python", default=f"{sys.version_info[0]}.{sys.version_info[1]}")
    checking.add_argument("--limit-mib", type=int, default=LIMIT_MIB)
    args = parser.parse_args(argv)
    if args.command == "pack":
        pack(args.bundle, args.tokenizer_from)
        print(f"{args.bundle}: {size_mib(args.bundle):.1f} MiB")
        return 0
    problems = check(args.bundle, args.python, args.limit_mib)
    if not problems:
        problem = load_tokenizer(args.bundle / "tokenizer")
        problems += [problem] if problem else []
    for problem in problems:
        print(f"gpu bundle: {problem}", file=sys.stderr)
    if problems:
        return 1
    wheels = sorted(p.name for p in (args.bundle / "wheels").glob("*.whl"))
    print(f"gpu bundle {args.bundle}: {len(wheels)} wheels for CPython {args.python}, "
          f"{size_mib(args.bundle / 'wheels'):.1f} MiB "
          f"(limit {args.limit_mib}); tokenizer {size_mib(args.bundle / 'tokenizer'):.1f} MiB")  # fmt: skip
    for name in wheels:
        print(f"  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
