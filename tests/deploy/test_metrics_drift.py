"""Drift between the server and deploy/: a real server (tiny model) is scraped, and every
tokenwire_* series that the dashboard, the alert rules or the autoscalers name must be
one its /metrics exports (or one that only a GPU host exports:
tokenwire_server.metrics.CUDA_METRIC_NAMES and NVML_METRIC_NAMES).

Names are compared as series, the way PromQL sees them: a histogram `x` exists only as
`x_bucket`, `x_sum` and `x_count`, a counter `x` as `x_total`. A family with labels but
no sample yet (no call finished) still counts: the exposition lists it by type."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from deploy_support import gpu_series, only, promql_metric_names, series_names, strings_in
from prometheus_client.parser import text_string_to_metric_families
from servers import ServerProcess

pytestmark = pytest.mark.timeout(240)
Objects = list[dict[str, Any]]


@pytest.fixture(scope="module")
def exported(tiny_model_dir: Path) -> set[str]:
    """Every series name the server's /metrics shows, read from a running server."""
    with ServerProcess(["--model", str(tiny_model_dir), "--metrics-port", "-1", "--no-warmup"]) as server:
        assert server.metrics_port > 0, "the server did not log its metrics port"
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    return series_names(text_string_to_metric_families(text))


def dashboard_names(rendered: dict[str, Objects]) -> set[str]:
    (configmap,) = only(rendered["monitoring"], "ConfigMap")
    (text,) = configmap["data"].values()
    return {name for s in strings_in(json.loads(text)) for name in promql_metric_names(s)}


def alert_names(rendered: dict[str, Objects]) -> set[str]:
    (rule,) = only(rendered["monitoring"], "PrometheusRule")
    return {name for s in strings_in(rule["spec"]) for name in promql_metric_names(s)}


def keda_names(rendered: dict[str, Objects]) -> set[str]:
    (scaled,) = only(rendered["keda"], "ScaledObject")
    return {name for s in strings_in(scaled["spec"]["triggers"]) for name in promql_metric_names(s)}


def hpa_names(rendered: dict[str, Objects]) -> set[str]:
    hpas = only(rendered["base"], "HorizontalPodAutoscaler") + only(rendered["cpu"], "HorizontalPodAutoscaler")
    return {m["pods"]["metric"]["name"] for hpa in hpas for m in hpa["spec"]["metrics"]}


SOURCES: dict[str, Callable[[dict[str, Objects]], set[str]]] = {
    "dashboard": dashboard_names,
    "alerts": alert_names,
    "keda": keda_names,
    "hpa": hpa_names,
}


def test_the_scrape_is_read_as_series(exported: set[str]) -> None:
    assert {"tokenwire_requests_total", "tokenwire_ready", "tokenwire_queue_depth"} <= exported
    assert "tokenwire_time_to_first_token_seconds_bucket" in exported
    # A histogram's or a counter's family name is no series of its own.
    assert "tokenwire_time_to_first_token_seconds" not in exported
    assert "tokenwire_requests" not in exported


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_deploy_uses_only_metrics_the_server_exports(
    exported: set[str], rendered: dict[str, Objects], source: str
) -> None:
    used = SOURCES[source](rendered)
    assert used, f"found no tokenwire_* metric in the {source}"
    unknown = used - exported - gpu_series()
    assert not unknown, f"the {source} uses series the server does not export: {sorted(unknown)}"
