"""Every suite of ``python -m benchmarks`` runs end to end under ``--dry-run``: its load loop,
statistics and report writer for real, against the fake servers of benchmarks/fake.py (and
the tiny model where the suite runs a model in process), in seconds. A suite whose run()
broke fails here, not at the start of an hour-long benchmark."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from benchmarks.__main__ import SUITES, main
from benchmarks.doc import HEADER

REPO = Path(__file__).resolve().parents[1]
EXTRA = {"ab": ["--old", str(REPO)]}  # the same tree twice


def test_list_names_every_suite(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == list(SUITES)


@pytest.mark.parametrize("suite", list(SUITES))
def test_each_suite_runs_against_the_fakes_and_writes_its_section(
    suite: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "benchmarks.md"
    argv = [suite, "--dry-run", "--model", str(tiny_model_dir), "--out", str(out), *EXTRA.get(suite, [])]
    assert main(argv) == 0
    text = out.read_text()
    assert text.startswith(getattr(importlib.import_module(SUITES[suite]), "HEADER", HEADER))  # its file's header
    body = text.split(": begin -->\n", 1)[1].split("\n<!-- ", 1)[0]
    assert body.startswith("## ") and f"python -m benchmarks {suite} --dry-run" in body
    rows = [line for line in body.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    assert len(rows) >= 2, body  # a header and at least one measured row
    assert not re.search(r"\bnan\b", body), body  # every figure was measured
