"""docs/operations.md documents exactly the server's flags: its configuration table has
one row per flag of `tokenwire-server --help`, with the right variable and default,
and every `--flag` it mentions anywhere is a real one (or another tool's, listed below)."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import pytest
from deploy_support import REPO, client_cli_help, only, server_config, server_series

DOC = REPO / "docs" / "operations.md"
# Flags of other commands the guide shows (docker, kubectl); `tokenwire health`'s come from its --help.
OTHER_TOOLS_FLAGS = {
    "--build-arg", "--gpus", "--rm", "--stop-timeout",  # docker
    "--from-file", "--raw",  # kubectl
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
        assert variable == expected_variable, (
            f"{flag}: variable {variable!r}, the server reads {expected_variable!r}"
        )
        expected_default = doc_default(parser.get_default(dest))
        assert default == expected_default, (
            f"{flag}: documented default {default!r}, the server's {expected_default!r}"
        )
    boolean = {f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(server_config.ServerConfig)
               if isinstance(f.default, bool)}  # fmt: skip
    for flag in boolean:
        assert f"--no-{flag[2:]}" in table_rows()[flag], f"{flag}: list --no-{flag[2:]} in its row"


def test_every_flag_mentioned_exists(help_text: str) -> None:
    mentioned = set(FLAG.findall(DOC.read_text()))
    health_help = client_cli_help("health")
    client_flags = set(FLAG.findall(health_help)) if health_help else {"--target", "--service"}
    unknown = mentioned - server_flags(help_text) - client_flags - OTHER_TOOLS_FLAGS - {"--help"}
    assert not unknown, f"docs/operations.md mentions flags that no command has: {sorted(unknown)}"


def test_guide_names_the_metrics_the_hpa_uses(rendered: dict[str, list[dict[str, Any]]]) -> None:
    text = DOC.read_text()
    for objects in rendered.values():
        for hpa in only(objects, "HorizontalPodAutoscaler"):
            for metric in hpa["spec"]["metrics"]:
                assert f"`{metric['pods']['metric']['name']}`" in text
    assert "prometheus-adapter" in text
    assert (
        "histogram_quantile(0.99, sum by (le) (rate(tokenwire_time_to_first_token_seconds_bucket[5m])))"
        in text
    )
    assert "sum(rate(tokenwire_generated_tokens_total[1m]))" in text


def test_every_metric_named_is_one_the_server_exports() -> None:
    named = set(re.findall(r"\btokenwire_[a-z_]+", DOC.read_text()))
    unknown = named - server_series()
    assert not unknown, f"docs/operations.md names series the server does not export: {sorted(unknown)}"
