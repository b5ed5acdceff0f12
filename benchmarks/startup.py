"""How long a server takes from exec to readiness, and where that time goes (`make bench-startup`)."""

from __future__ import annotations

import argparse
import time

from benchmarks import doc
from benchmarks.launcher import ServerProcess
from benchmarks.stats import median, spread

FLAGS = {"repeats": 5, "server_args": ("", "extra server flags, space-separated")}
DRY_RUN = {"repeats": 1}
POLL_S = 0.02


def start_once(model: str, extra: list[str]) -> tuple[float, dict[str, float]]:
    """(seconds from exec to readiness SERVING at the client, the phases of the server's "ready" line)."""
    started = time.monotonic()
    with ServerProcess(["--model", model, *extra], wait=False) as server:
        server.wait_listening(600)
        server.wait_ready(600 - (time.monotonic() - started), poll=POLL_S)
        serving = time.monotonic() - started
        [ready] = server.wait_for("ready")
        return serving, dict(ready["phases"])


def run(args: argparse.Namespace) -> doc.Section:
    extra = args.server_args.split()
    totals: list[float] = []
    phases: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        total, seen = start_once(args.model, extra)
        totals.append(total)
        for name, seconds in seen.items():
            phases.setdefault(name, []).append(seconds)
        doc.log(f"repeat {repeat}: ready in {total:.2f} s; {seen}")
    return doc.section(
        "startup", "Start-up: exec to readiness (`make bench-startup`)", args.command,
        f"{doc.host()}. Model `{args.model}`{' with ' + args.server_args if args.server_args else ''}; "
        f"{args.repeats} fresh server processes one after another, each polled every {POLL_S * 1000:.0f} ms "
        "from exec until readiness answers SERVING. Seconds: median (min–max) over the repeats; the phases are "
        "the server's own (its \"ready\" line), so their sum falls a little short of the total (log lines, the "
        "gaps between phases, the client's poll).",
        "",
        *doc.table("what | seconds", "lr", [["**exec → readiness SERVING**", f"**{spread(totals, 2)}**"],
                                           *([name, spread(values, 2)] for name, values in phases.items())]),
        "",
        f"- median {median(totals):.2f} s; "
        f"the phases' medians add up to {sum(median(v) for v in phases.values()):.2f} s",
    )  # fmt: skip
