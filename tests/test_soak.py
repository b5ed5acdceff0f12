"""The soak's own logic (benchmarks/soak.py): its mix sends every kind of call, and a short run
against the tiny model ends each kind in the status that kind expects, keeps every contract it
checks (structured answers, resumed streams) and passes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from benchmarks.__main__ import parser_for
from benchmarks.soak import MIX, TENANT_MIX, Traffic, passed, render_doc, soak

pytestmark = pytest.mark.timeout(240)

# What each kind of call may end in. A burst fills admission (active + queued), so a
# generation that arrives beside it may be refused with RESOURCE_EXHAUSTED; the calls refused
# before admission (bad request, bad token, priority above the cap) may not.
ADMITTED = {"OK", "RESOURCE_EXHAUSTED"}
EXPECTED = {
    "malformed": {"INVALID_ARGUMENT"},
    "cancelled": {"CANCELLED"} | ADMITTED,  # OK: it ended before the client's cancel
    "short-deadline": {"DEADLINE_EXCEEDED"} | ADMITTED,
    "long": ADMITTED,
    "short": ADMITTED,
    "structured": ADMITTED,
    "resume-cut": {"CANCELLED"} | ADMITTED,
    "resume": ADMITTED,
    "burst": ADMITTED,
    "unauthenticated": {"UNAUTHENTICATED"},
    "priority-above-cap": {"INVALID_ARGUMENT"},
    "metered": ADMITTED,  # RESOURCE_EXHAUSTED: its own quota
}


def test_the_mix_sends_every_kind_first_and_the_tenant_kinds_only_with_tenants() -> None:
    args = parser_for("soak").parse_args([])
    tokens = {"interactive": "a", "batch": "b", "metered": "c"}
    with_tenants = Traffic(None, args, random.Random(0), tokens)  # type: ignore[arg-type]
    first = [with_tenants.pick() for _ in range(len(with_tenants.kinds))]
    assert [c.kind for c in first] == [k for k, _ in MIX] + [k for k, _ in TENANT_MIX] + ["short"]
    by_kind = {c.kind: c for c in first}
    assert by_kind["unauthenticated"].metadata == (("authorization", "Bearer not-a-token"),)
    assert by_kind["priority-above-cap"].tenant == "batch" and by_kind["metered"].metadata == (
        ("authorization", "Bearer c"),
    )
    assert all(c.metadata for c in first)  # a server with tokens refuses a call without one
    assert by_kind["structured"].request.HasField("response_format")

    without = Traffic(None, args, random.Random(0), {})  # type: ignore[arg-type]
    drawn = {without.pick().kind for _ in range(400)}
    assert drawn == {k for k, _ in MIX} | {"short"}
    assert not without.pick().metadata


def test_a_short_soak_sends_every_kind_and_each_ends_as_its_kind_expects(tiny_model_dir: Path) -> None:
    argv = [
        "--model", str(tiny_model_dir), "--minutes", "0.2", "--rate", "6", "--concurrency", "16",
        "--short-tokens", "4", "--long-tokens", "12", "--burst-tokens", "2",
        "--cancel-storm", "20", "--cancel-storm-seconds", "30",
    ]  # fmt: skip
    report = soak(parser_for("soak").parse_args(argv))
    assert report["server_alive"] and report["bad"] == {"UNKNOWN": 0, "INTERNAL": 0}
    assert report["violations"] == []
    assert set(report["by_kind"]) == set(EXPECTED)
    for kind, codes in report["by_kind"].items():
        assert set(codes) <= EXPECTED[kind], f"{kind}: {codes}"
    assert report["by_kind"]["unauthenticated"] == {
        "UNAUTHENTICATED": report["by_kind"]["unauthenticated"]["UNAUTHENTICATED"]
    }
    assert "OK" in report["by_kind"]["resume"] and "OK" in report["by_kind"]["structured"]
    assert set(report["by_tenant"]) == {"interactive", "batch", "metered", "wrong-token"}
    assert report["tenants"] == ["batch", "interactive", "metered"]
    assert report["cancel_storm"]["cancelled"] == 20
    assert passed(report)
    doc = render_doc(report)
    assert "### Calls by tenant and status" in doc and "| resume | " in doc and "| structured | " in doc
    json.dumps(report)  # what --json writes
