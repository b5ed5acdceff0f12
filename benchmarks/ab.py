"""Two source trees side by side, in turns: did a change move the pace? (`python -m benchmarks ab`)

``--old``/``--new``: a folder with the tree's ``service/`` and ``client/``, or a git revision (checked out once
under ``--workdir``); each case from a fresh process that imports that tree first. Writes nothing without ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import doc, load
from benchmarks.launcher import REPO, serve
from benchmarks.stats import ratios, spread

OUT = None  # a quick check by default: nothing written
FLAGS = {"old": {"required": True, "help": "a tree (folder) or a git revision"},
         "new": (str(REPO), "a tree (folder) or a git revision"),
         "repeats": 3, "max_new_tokens": 128, "cases": "c1,c16,long",
         "requests_per_stream": (2, "server cases: requests per stream"),
         "server_arg": ([], "server cases: extra flag (repeatable)"),
         "workdir": Path("/tmp/tokenwire-revisions"), "section": ("ab", "the section of --out the table replaces"),
         "label": ("old tree vs new tree", "what the two trees are, for the section")}  # fmt: skip
DRY_RUN = {"repeats": 1, "cases": "c1-sampled,server-c2", "max_new_tokens": 4}  # in process (sampled) and served
# -controls: -sampled plus OpenAI's controls, a 100-entry logit_bias (10 of them bans) among them (#40; a tree
# without them fails the case)
BIAS = tuple((t, -100.0 if t % 10 == 0 else 1.5) for t in range(30000, 30100))
CONTROLS = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "min_p": 0.05, "logit_bias": BIAS}


def tree(given: str, workdir: Path) -> Path:
    """``given`` as a folder, else a worktree of the git revision it names (a fresh one when its commit moved)."""
    if Path(given).is_dir():
        return Path(given).resolve()
    git = ["git", "-C", str(REPO)]
    commit = subprocess.run([*git, "rev-parse", given], capture_output=True, text=True, check=True).stdout.strip()
    folder = workdir / commit[:12]
    if not folder.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        subprocess.run([*git, "worktree", "add", "--detach", "-q", str(folder), commit], check=True)
    return folder


def child(model: str, case: str, max_new: int) -> dict[str, Any]:
    """One in-process case on the batched engine of the tree this process imports."""
    from tokenwire.bench import DEFAULT_PROMPTS
    from tokenwire_server.domain import FinishEvent, GenerationRequest, SamplingOptions, TextEvent
    from tokenwire_server.engine import create_engine
    from tokenwire_server.engine.base import EngineLimits
    from tokenwire_server.model import load_model

    from benchmarks.bench import LONG_PROMPT_FILLER, stall

    def build() -> tuple[Any, Any]:
        loaded = load_model(model, device="cpu", dtype="float32")
        return loaded, create_engine("batched", loaded, EngineLimits(16, 16, 16 * 2048), workers=1)

    loaded, engine = load.in_thread(build)  # as the server loads (TokenwireServer.load)
    # As the server does once loaded (server.settle_heap): the loaded objects leave the
    # collector's reach, so a full collection does not stall the engine ~200 ms mid-run.
    gc.collect()
    gc.freeze()
    prompts = [load.chat_ids(loaded.tokenizer, p) for p in DEFAULT_PROMPTS]
    engine.start()

    class Sink:
        def __init__(self, rid: str, ids: list[int], new: int, sampling: Any = None) -> None:
            self.times: list[float] = []
            self.done = threading.Event()
            sampling = sampling or SamplingOptions(temperature=0.0)
            request = GenerationRequest(rid, list(ids), sampling, new, ignore_eos=True, want_tokens=True)
            self.handle = engine.submit(request, self)

        def __call__(self, event: object) -> None:
            if isinstance(event, TextEvent | FinishEvent):
                self.times.append(time.perf_counter())
            if not isinstance(event, TextEvent):
                self.done.set()

    try:
        Sink("warm", prompts[0], 8).done.wait(120)
        streams, _, kind = case.partition("-")
        if streams in ("c1", "c16") and kind in ("", "sampled", "controls", "free"):
            n, started = int(streams[1:]), time.perf_counter()
            extra = {"free": {}, "controls": {"top_p": 0.95, **CONTROLS}}.get(kind, {"top_p": 0.95})
            sampled = [SamplingOptions(temperature=0.8, seed=1000 + i, **extra) for i in range(n)]
            sinks = [Sink(f"r{i}", prompts[i % len(prompts)], max_new, sampled[i] if kind else None) for i in range(n)]
            for s in sinks:
                s.done.wait(600)
            return {"tok_s": n * max_new / (time.perf_counter() - started)}
        sinks = [Sink(f"d{i}", prompts[i % len(prompts)], 400) for i in range(8)]
        while min(len(s.times) for s in sinks) < 20:
            time.sleep(0.01)
        arrived = time.perf_counter()
        big = Sink("long", loaded.tokenizer(LONG_PROMPT_FILLER)["input_ids"][:1500], 4)
        big.done.wait(600)
        time.sleep(0.5)  # a few more steps after the long prompt's last token, then stop the 8
        for s in sinks:
            s.handle.cancel()
            s.handle.done.wait(60)
        p50, worst = stall([s.times for s in sinks], arrived, big.times[-1])
        return {"itl_p50_ms": p50 * 1000, "max_gap_ms": worst * 1000, "long_ttft_ms": (big.times[0] - arrived) * 1000}
    finally:
        engine.close()


def measure(args: argparse.Namespace, case: str, folder: Path) -> dict[str, Any]:
    """One case on one tree, from a fresh process (or server) that imports that tree first."""
    path = f"{folder / 'service'}:{folder / 'client'}:{REPO}"
    if case.startswith("server-c"):
        c = int(case[len("server-c") :])
        flags = ["--model", args.model, "--max-active", str(c), *args.server_arg]
        with serve(args.dry_run, flags, env={"PYTHONPATH": path}, ready_timeout=600) as server:
            load.warm(server.target)
            m = load.grpc_load(server.target, case, c, c * args.requests_per_stream, args.max_new_tokens)
        ratio = m.itl_p99 / m.itl_p50 if m.itl_p99 is not None and m.itl_p50 else float("nan")  # nan: no gaps
        return {"tok_s": m.tokens_per_s, "itl_p99_over_p50": ratio}
    command = [sys.executable, "-m", "benchmarks.ab", args.model, case, str(args.max_new_tokens)]
    out = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if not line:
        raise RuntimeError(f"{case} on {folder} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return dict(json.loads(line[0][len("RESULT ") :]))


def run(args: argparse.Namespace) -> doc.Section:
    trees = {"old": tree(args.old, args.workdir), "new": tree(args.new, args.workdir)}
    cases = args.cases.split(",")
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for repeat in range(args.repeats):
        for case in cases:
            for label in ("old", "new") if repeat % 2 == 0 else ("new", "old"):
                result = measure(args, case, trees[label])
                results.setdefault((case, label), []).append(result)
                doc.log(f"repeat {repeat} {case} {label}: {result}")
    rows = []
    for case in cases:
        old, new = results[(case, "old")], results[(case, "new")]
        for metric in old[0]:
            before, after = [r[metric] for r in old], [r[metric] for r in new]
            rows.append([case, metric, spread(before), spread(after), spread(ratios(after, before), 2)])
        if case == "long":
            for label, runs in (("old", old), ("new", new)):
                stall = spread([r["max_gap_ms"] / r["itl_p50_ms"] for r in runs], 2)
                rows.append(["long", f"stall ({label})", "", "", f"{stall}×"])
    return doc.section(
        args.section, f"Two trees side by side: {args.label}", args.command,
        f"{doc.host()}. Each repeat runs every case once on each tree, alternating, each in a fresh process; "
        f"c1/c16: tokens/s of 1 or 16 greedy streams of {args.max_new_tokens} tokens on the batched engine in "
        "process (-sampled: temperature 0.8, top_p 0.95, a seed per stream; -free: temperature 0.8 alone, as a "
        "caller who sets only a temperature; -controls: -sampled plus presence 0.5, "
        "frequency 0.3, min_p 0.05 and a 100-entry logit_bias); long: 8 streams decode while a "
        "~1,500-token prompt is read (their largest gap ÷ their ITL p50 before it: the stall); server-cN: tokens/s of "
        "N streams over gRPC, and their ITL p99 ÷ p50 (client-side). Cells: median (min–max) over the repeats; "
        "ratios: new ÷ old per repeat.",
        "",
        *doc.table("case | metric | old | new | new ÷ old", "llrrr", rows),
    )  # fmt: skip


if __name__ == "__main__":  # the child of one in-process case: MODEL CASE MAX_NEW
    print("RESULT " + json.dumps(child(sys.argv[1], sys.argv[2], int(sys.argv[3]))), flush=True)
