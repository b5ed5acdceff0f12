"""Did a change move the server's pace? Two git revisions served side by side, in turns.

    python -m benchmarks.revisions OLD NEW [--concurrency 1,16] [--repeats 3] [--server-arg ...]

Each revision is checked out into a worktree of its own (under ``--workdir``) and served
from it with this venv (``PYTHONPATH`` puts its ``service/`` and ``client/`` first), on the
default model unless ``--server-arg --model=...``. The repeats alternate which goes first,
and each repeat measures both at every concurrency, so a noisy host moves both alike; the
verdict is the ratio NEW ÷ OLD inside each repeat, min / median / max.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worktree(revision: str, workdir: Path) -> Path:
    """A worktree of ``revision`` (a fresh one when its commit moved)."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", revision], capture_output=True, text=True, check=True).stdout.strip()
    folder = workdir / commit[:12]
    if not folder.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(folder), commit], check=True)
    return folder


def main(argv: list[str] | None = None) -> int:
    from tokenwire.bench import run_bench

    from benchmarks.launcher import ServerProcess

    parser = argparse.ArgumentParser(prog="python -m benchmarks.revisions", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--server-arg", action="append", default=[], help="extra server flag (repeatable)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tokenwire-revisions"))
    args = parser.parse_args(argv)
    trees = {name: worktree(name, args.workdir) for name in (args.old, args.new)}
    concurrency = [int(c) for c in args.concurrency.split(",")]
    model = [] if any(a.startswith("--model") for a in args.server_arg) else ["--model", "default"]
    rates: dict[tuple[str, int], list[float]] = {}
    for repeat in range(args.repeats):
        order = [args.old, args.new] if repeat % 2 == 0 else [args.new, args.old]
        for name in order:
            tree = trees[name]
            env = {"PYTHONPATH": f"{tree}/service:{tree}/client"}
            with ServerProcess([*model, "--max-active", str(max(concurrency)), *args.server_arg], env=env, ready_timeout=600) as server:
                run_bench(server.target, concurrency=1, requests=1, max_new_tokens=4)  # warm
                for c in concurrency:
                    report = run_bench(server.target, concurrency=c, requests=c * args.requests_per_stream, max_new_tokens=args.max_new_tokens)
                    rates.setdefault((name, c), []).append(report.output_tokens_per_s)
                    print(f"repeat {repeat} {name} c={c}: {report.output_tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
    print(f"python -m benchmarks.revisions {' '.join(argv if argv is not None else sys.argv[1:])}")
    print("| c | OLD tok/s (repeats) | NEW tok/s (repeats) | NEW ÷ OLD min / median / max |")
    print("|---:|---|---|---|")
    for c in concurrency:
        old, new = rates[(args.old, c)], rates[(args.new, c)]
        ratios = sorted(b / a for a, b in zip(old, new, strict=True))
        print(f"| {c} | {', '.join(f'{x:.1f}' for x in old)} | {', '.join(f'{x:.1f}' for x in new)} "
              f"| {ratios[0]:.3f} / {statistics.median(ratios):.3f} / {ratios[-1]:.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
