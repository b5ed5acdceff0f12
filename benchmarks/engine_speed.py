"""The batched engine in-process, two source trees side by side (e.g. before and after a change).

    python -m benchmarks.engine_speed --old /tmp/old-service --repeats 3

runs, for each repeat, every case once on each tree (alternating, each in a fresh
subprocess with that tree's ``service/`` first on sys.path) and prints min/median/max:

- ``c1`` / ``c16``: tokens/s of 1 or 16 concurrent greedy streams, 128 new tokens,
  ``ignore_eos``, chat prompts (the DEFAULT_PROMPTS of ``tokenwire.bench``);
- ``long``: 8 streams decode, a ~1,500-token prompt arrives; the largest inter-token
  gap of the 8 while it is read, against their ITL p50.

The machine is shared: compare the trees within one run, not across runs. With
``--section NAME`` the result (each metric's min/median/max per tree, and the per-repeat
new ÷ old ratios) also replaces section NAME of ``--out`` (docs/benchmarks.md), with
``--label`` saying what the two trees are.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def child(case: str, max_new: int) -> dict[str, Any]:
    from tokenwire.bench import DEFAULT_PROMPTS, percentile
    from tokenwire_server.domain import FinishEvent, GenerationRequest, SamplingOptions, TextEvent
    from tokenwire_server.engine import create_engine
    from tokenwire_server.engine.base import EngineLimits
    from tokenwire_server.model import load_model, prepare_default_model

    built: dict[str, Any] = {}

    def build() -> None:
        # In a thread that ends, as the server does (TokenwireServer.load): a thread
        # that ran torch in parallel and lives on keeps a second OpenMP pool, which
        # slows the engine loop's.
        built["loaded"] = load_model(str(prepare_default_model()), device="cpu", dtype="float32")
        built["engine"] = create_engine("batched", built["loaded"], EngineLimits(16, 16, 16 * 2048), workers=1)

    loader = threading.Thread(target=build)
    loader.start()
    loader.join()
    # As the server does once loaded (server.settle_heap): the loaded objects leave the
    # collector's reach, so a full collection does not stall the engine ~200 ms mid-run.
    gc.collect()
    gc.freeze()
    loaded, engine = built["loaded"], built["engine"]
    tok = loaded.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False)
        for p in DEFAULT_PROMPTS
    ]
    engine.start()

    class Sink:
        def __init__(self) -> None:
            self.times: list[float] = []
            self.done = threading.Event()
            self.handle: Any = None

        def __call__(self, event: object) -> None:
            if isinstance(event, TextEvent | FinishEvent):
                self.times.append(time.perf_counter())
            if not isinstance(event, TextEvent):
                self.done.set()

    def submit(rid: str, ids: list[int], new: int) -> Sink:
        sink = Sink()
        req = GenerationRequest(rid, list(ids), SamplingOptions(temperature=0.0), new, ignore_eos=True, want_tokens=True)
        sink.handle = engine.submit(req, sink)
        return sink

    try:
        submit("warm", prompts[0], 8).done.wait(120)
        if case in ("c1", "c16"):
            n = 1 if case == "c1" else 16
            started = time.perf_counter()
            sinks = [submit(f"r{i}", prompts[i % len(prompts)], max_new) for i in range(n)]
            for s in sinks:
                s.done.wait(600)
            elapsed = time.perf_counter() - started
            return {"tok_s": n * max_new / elapsed}
        # long: 8 streams decoding, then a ~1,500-token prompt arrives
        sinks = [submit(f"d{i}", prompts[i % len(prompts)], 400) for i in range(8)]
        while min(len(s.times) for s in sinks) < 20:
            time.sleep(0.01)
        filler = " ".join(f"item {i} is {i * 7 % 13}." for i in range(300))
        long_ids = tok(filler)["input_ids"][:1500]
        arrived = time.perf_counter()
        big = submit("long", long_ids, 4)
        big.done.wait(600)
        first_token = big.times[0] - arrived if big.times else None
        time.sleep(0.5)  # a few more steps after the long prompt's last token, then stop the 8
        for s in sinks:
            s.handle.cancel()
            s.handle.done.wait(60)
        gaps_before: list[float] = []
        worst = 0.0
        for s in sinks:
            pairs = list(zip(s.times, s.times[1:], strict=False))
            gaps_before += [b - a for a, b in pairs if b < arrived]
            worst = max([worst] + [b - a for a, b in pairs if b > arrived and a < big.times[-1]])
        return {
            "itl_p50_ms": percentile(gaps_before, 50) * 1000,
            "max_gap_ms": worst * 1000,
            "long_ttft_ms": (first_token or 0) * 1000,
            "prompt_tokens": len(long_ids),
        }
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True, help="a tree with the old service/ (e.g. git worktree or archive)")
    parser.add_argument("--new", type=Path, default=REPO)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--cases", default="c1,c16,long")
    parser.add_argument("--section", default="", help="write the result as this section of --out")
    parser.add_argument("--label", default="old tree vs new tree", help="what the two trees are, for the section")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.max_new)), flush=True)
        return 0
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    for repeat in range(args.repeats):
        for case in args.cases.split(","):
            for label, tree in trees.items():
                env_path = f"{tree / 'service'}:{REPO / 'client'}:{REPO}"
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.engine_speed", "--old", str(args.old), "--child", case, "--max-new", str(args.max_new)],
                    cwd=REPO,
                    env={**__import__("os").environ, "PYTHONPATH": env_path},
                    capture_output=True,
                    text=True,
                    check=False,
                )
                line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                if not line:
                    print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                    raise SystemExit(f"{label} {case} failed")
                result = json.loads(line[0][7:])
                results.setdefault((case, label), []).append(result)
                print(f"repeat {repeat} {case} {label}: {result}", flush=True)
    print("\ncase   tree  metric          min      median   max")
    for (case, label), runs in sorted(results.items()):
        for metric in runs[0]:
            values = [r[metric] for r in runs]
            print(f"{case:6} {label:5} {metric:14} {min(values):8.1f} {statistics.median(values):8.1f} {max(values):8.1f}")
    if args.section:
        write_section(args, results, argv if argv is not None else sys.argv[1:])
    return 0


def write_section(args: argparse.Namespace, results: dict[tuple[str, str], list[dict[str, Any]]], argv: list[str]) -> None:
    from benchmarks.bench import machine
    from benchmarks.doc import replace_section
    from benchmarks.peers import spread

    info = machine()
    command = "python -m benchmarks.engine_speed " + " ".join(argv)
    lines = [
        f"## The batched engine in-process, two trees side by side: {args.label}",
        "",
        f"Written by `{command.strip()}` at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; do not edit by hand.",
        f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}. Each repeat runs every case once on each tree, "
        "alternating, each in a fresh process; c1/c16: tokens/s of 1 or 16 greedy streams of "
        f"{args.max_new} tokens; long: 8 streams decode while a ~1,500-token prompt is read (their largest gap ÷ "
        "their ITL p50 before it: the stall). Cells: median (min–max) over the repeats; ratios: new ÷ old per repeat.",
        "",
        "| case | metric | old | new | new ÷ old |",
        "|---|---|---:|---:|---:|",
    ]
    for case in args.cases.split(","):
        old, new = results[(case, "old")], results[(case, "new")]
        for metric in ("tok_s", "itl_p50_ms", "max_gap_ms", "long_ttft_ms"):
            if metric not in old[0]:
                continue
            ratios = [n[metric] / o[metric] for o, n in zip(old, new, strict=True)]
            lines.append(
                f"| {case} | {metric} | {spread([r[metric] for r in old])} | {spread([r[metric] for r in new])} | {spread(ratios, 2)} |"
            )
        if case == "long":
            for label, runs in (("old", old), ("new", new)):
                stalls = [r["max_gap_ms"] / r["itl_p50_ms"] for r in runs]
                lines.append(f"| long | stall ({label}) | | | {spread(stalls, 2)}× |")
    replace_section(args.out, args.section, "\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
