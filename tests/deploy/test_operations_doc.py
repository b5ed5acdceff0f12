"""docs/operations.md documents exactly the server's flags: its configuration table has
one row per flag of `tokenwire-server --help`, with the right variable and default,
and every `--flag` it mentions anywhere is a real one (or another tool's, listed below).
Every metric it names is one the server exports, every alert of deploy/monitoring has its
runbook section, and it says how to apply every kustomization in deploy/."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import pytest
from deploy_support import (
    HPA_WORKLOADS,
    KUSTOMIZATIONS,
    REPO,
    client_cli_help,
    gpu_series,
    only,
    promql_metric_names,
    server_config,
    server_series,
    vllm_series,
)

DOC = REPO / "docs" / "operations.md"
# Flags of other commands the guide shows (docker, kubectl); `tokenwire health`'s come from its --help.
OTHER_TOOLS_FLAGS = {
    "--build-arg", "--gpus", "--ipc", "--rm", "--shm-size", "--stop-timeout",  # docker
    "--from-file", "--raw", "--tail",  # kubectl
}  # fmt: skip
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@pytest.fixture()
def help_text(monkeypatch: pytest.MonkeyPatch) -> str:
    """`tokenwire-server --help` with no TOKENWIRE_* variable set (defaults as shipped)."""
    for name in list(os.environ):
        if name.startswith(server_config.ENV_PREFIX):
            monkeypatch.delenv(name)
    return server_config.build_parser().format_help()


def server_flags(help_text: str) -> set[str]:
    return set(FLAG.findall(help_text)) - {"--help"}


def table_rows() -> dict[str, list[str]]:
    """The configuration table: {flag: [variable, default]}, `--no-x` rows under `--x`."""
    rows: dict[str, list[str]] = {}
    for line in DOC.read_text().splitlines():
        if not line.startswith("| `--"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        flags = FLAG.findall(cells[0])
        rows[flags[0]] = [cells[1].strip("`"), cells[2].strip("`"), *flags[1:]]
    return rows


def doc_default(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    if value is None:  # a repeatable flag (--lora) given no value
        return "none"
    return str(value)


def test_table_lists_every_server_flag(help_text: str) -> None:
    rows = table_rows()
    listed = set(rows) | {flag for row in rows.values() for flag in row[2:]}
    missing = server_flags(help_text) - listed
    assert not missing, f"add rows for {sorted(missing)} to docs/operations.md (Configuration)"
    unknown = listed - server_flags(help_text)
    assert not unknown, f"docs/operations.md documents flags the server lacks: {sorted(unknown)}"


def test_table_gives_each_flags_variable_and_default(help_text: str) -> None:
    parser = server_config.build_parser()
    fields = {f.name for f in dataclasses.fields(server_config.ServerConfig)}
    for flag, (variable, default, *_) in table_rows().items():
        dest = flag[2:].replace("-", "_")
        expected_variable = server_config.env_name(dest) if dest in fields else "—"
        assert variable == expected_variable, f"{flag}: variable {variable!r}, the server reads {expected_variable!r}"
        expected_default = doc_default(parser.get_default(dest))
        assert default == expected_default, f"{flag}: documented default {default!r}, the server's {expected_default!r}"
    boolean = {f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(server_config.ServerConfig)
               if isinstance(f.default, bool)}  # fmt: skip
    for flag in boolean:
        assert f"--no-{flag[2:]}" in table_rows()[flag], f"{flag}: list --no-{flag[2:]} in its row"


def test_every_flag_mentioned_exists(help_text: str) -> None:
    mentioned = set(FLAG.findall(DOC.read_text()))
    client_flags = set(FLAG.findall(client_cli_help("health"))) | set(FLAG.findall(client_cli_help("generate")))
    assert {"--target", "--service"} <= client_flags
    unknown = mentioned - server_flags(help_text) - client_flags - OTHER_TOOLS_FLAGS - {"--help"}
    assert not unknown, f"docs/operations.md mentions flags that no command has: {sorted(unknown)}"


def test_guide_names_the_metrics_the_hpa_uses(rendered: dict[str, list[dict[str, Any]]]) -> None:
    text = DOC.read_text()
    for name in HPA_WORKLOADS:
        (hpa,) = only(rendered[name], "HorizontalPodAutoscaler")
        for metric in hpa["spec"]["metrics"]:
            assert f"`{metric['pods']['metric']['name']}`" in text
    assert "prometheus-adapter" in text
    assert "histogram_quantile(0.99, sum by (le) (rate(tokenwire_time_to_first_token_seconds_bucket[5m])))" in text
    assert "sum(rate(tokenwire_generated_tokens_total[1m]))" in text


def test_every_metric_named_is_one_the_server_exports() -> None:
    named = promql_metric_names(DOC.read_text())
    assert len(named) >= 10
    # Engine-specific names count too: the tokenwire_vllm_* gauges exist only on a server
    # started with --engine vllm (registered from VllmBackend.extra_gauges), so a
    # Metrics() built here does not have them.
    unknown = named - server_series() - gpu_series() - vllm_series()
    assert not unknown, f"docs/operations.md names series the server does not export: {sorted(unknown)}"


def test_guide_documents_the_vllm_engine() -> None:
    assert "vllm-engine" in sections(), "no section #vllm-engine"
    text = DOC.read_text()
    assert "](#vllm-engine)" in text, "no link to #vllm-engine (table of contents)"
    for needle in ("make setup-vllm", "--build-arg ENGINE=vllm", "--tensor-parallel-size",
                   "--pipeline-parallel-size", "--enforce-eager", "KubeRay", "/dev/shm"):  # fmt: skip
        assert needle in text, f"the vLLM section does not mention {needle}"
    for name in vllm_series():
        assert f"`{name}`" in text, f"document the vllm engine's gauge {name}"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections() -> dict[str, list[str]]:
    """{anchor of each `## ` section: [anchors of its `### ` subsections]}."""
    found: dict[str, list[str]] = {}
    current = ""
    in_code = False
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif in_code:
            continue
        elif line.startswith("## "):
            current = github_anchor(line[3:])
            assert current not in found, f"two sections named {line}"
            found[current] = []
        elif line.startswith("### "):
            found[current].append(github_anchor(line[4:]))
    return found


def test_every_alert_has_its_runbook(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Each alert's runbook_url points at its own subsection of "Alerts and runbooks", and each
    subsection there belongs to an alert."""
    (rule,) = only(rendered["monitoring"], "PrometheusRule")
    alerts = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    anchors = {r["alert"]: r["annotations"]["runbook_url"].rpartition("#")[2] for r in alerts}
    for alert, anchor in anchors.items():
        assert anchor == alert.lower(), f"{alert}: runbook_url points at #{anchor}"
    runbooks = sections()["alerts-and-runbooks"]
    assert sorted(runbooks) == sorted(anchors.values()), "one subsection per alert, named after it"
    text = DOC.read_text()
    for alert in anchors:
        assert f"[{alert}](#{alert.lower()})" in text, f"list {alert} in the table of alerts"


def test_guide_covers_monitoring_and_autoscaling() -> None:
    found = sections()
    for anchor in ("dashboards", "alerts-and-runbooks", "autoscaling", "autoscaling-keda-or-hpa"):
        assert anchor in found, f"no section #{anchor}"
        assert f"](#{anchor})" in DOC.read_text(), f"no link to #{anchor} (table of contents)"
    text = DOC.read_text()
    for path in KUSTOMIZATIONS.values():
        relative = path.relative_to(REPO).as_posix()
        assert re.search(rf"kubectl apply (-n \S+ )?-k {re.escape(relative)}\b", text), (
            f"the guide does not say how to apply {relative}"
        )
    assert "grafana_dashboard" in text and "disableNameSuffixHash" in text
    assert "minReplicaCount" in text and "startupProbe" in text and "waitForReady" in text
