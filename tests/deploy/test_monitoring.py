"""deploy/monitoring: the Grafana dashboard (a ConfigMap for Grafana's sidecar), the alert
rules (PrometheusRule) and the scrape (ServiceMonitor) are well formed, show and alert on
what an operator needs, and select the Services and ports that deploy/ renders.
Whether the metric names they use are ones the server exports: test_metrics_drift.py."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml
from deploy_support import (
    KUSTOMIZATIONS,
    METRICS_PORT,
    WORKLOADS,
    only,
    promql_metric_names,
    server_container,
)

Objects = list[dict[str, Any]]
DASHBOARD_FILE = "tokenwire-dashboard.json"
DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")


@pytest.fixture(scope="module")
def monitoring(rendered: dict[str, Objects]) -> Objects:
    return rendered["monitoring"]


@pytest.fixture(scope="module")
def dashboard(monitoring: Objects) -> dict[str, Any]:
    """The dashboard as shipped: the JSON inside the rendered ConfigMap."""
    (configmap,) = only(monitoring, "ConfigMap")
    return json.loads(configmap["data"][DASHBOARD_FILE])


@pytest.fixture(scope="module")
def rules(monitoring: Objects) -> list[dict[str, Any]]:
    (rule,) = only(monitoring, "PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel but rows (including those inside collapsed rows)."""
    out = []
    for panel in dashboard["panels"]:
        out += panel.get("panels", []) if panel["type"] == "row" else [panel]
    return out


def expressions(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in panels(dashboard) for target in panel["targets"]]


def compact(expr: str) -> str:
    return re.sub(r"\s+", "", expr)


# --- the dashboard ---------------------------------------------------------------


def test_dashboard_ships_as_a_configmap_for_the_grafana_sidecar(monitoring: Objects) -> None:
    (configmap,) = only(monitoring, "ConfigMap")
    kustomization = yaml.safe_load((KUSTOMIZATIONS["monitoring"] / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    # No hash suffix: a new version replaces the ConfigMap instead of adding a second dashboard.
    assert generator["options"]["disableNameSuffixHash"] is True
    assert configmap["metadata"]["name"] == generator["name"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert set(configmap["data"]) == {DASHBOARD_FILE}
    source = (KUSTOMIZATIONS["monitoring"] / DASHBOARD_FILE).read_text()
    assert json.loads(configmap["data"][DASHBOARD_FILE]) == json.loads(source)
    # `kubectl apply` (client side) keeps the whole object in an annotation of at most 256 KiB.
    assert len(json.dumps(configmap)) < 256 * 1024


def test_dashboard_reads_its_datasource_from_a_variable(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    expected = {"type": "prometheus", "uid": "${datasource}"}
    for variable in variables.values():
        assert variable["type"] == "datasource" or variable["datasource"] == expected, variable["name"]
    for panel in panels(dashboard):
        assert panel["datasource"] == expected, panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", expected) == expected, panel["title"]


def test_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    ids = [panel["id"] for panel in dashboard["panels"]] + [
        p["id"] for row in dashboard["panels"] for p in row.get("panels", [])
    ]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
    for panel in panels(dashboard):
        assert panel["title"] and panel["targets"], panel
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        assert all(target["expr"].strip() for target in panel["targets"]), panel["title"]


def test_dashboard_queries_follow_the_variables(dashboard: dict[str, Any]) -> None:
    """Every series is filtered by the namespace and pod chosen; rates use $__rate_interval
    (at least four scrapes, whatever the scrape interval)."""
    for expr in expressions(dashboard):
        selectors = re.findall(r"\btokenwire_[a-z0-9_]+(\{[^}]*\})?", expr)
        assert selectors, expr
        for selector in selectors:
            assert 'namespace=~"$namespace"' in selector and 'pod=~"$pod"' in selector, expr
        ranges = re.findall(r"\[([^\]]+)\]", expr)
        assert all(r == "$__rate_interval" for r in ranges), expr


def quantiles_of(dashboard: dict[str, Any], histogram: str) -> set[float]:
    found = set()
    for expr in map(compact, expressions(dashboard)):
        for q, body in re.findall(r"histogram_quantile\((0\.\d+),(.*)", expr):
            if f"rate({histogram}_bucket{{" in body:
                found.add(float(q))
    return found


@pytest.mark.parametrize(
    "histogram",
    [
        "tokenwire_time_to_first_token_seconds",
        "tokenwire_inter_token_latency_seconds",
        "tokenwire_queue_wait_seconds",
    ],
)
def test_dashboard_shows_latency_p50_and_p99(dashboard: dict[str, Any], histogram: str) -> None:
    assert quantiles_of(dashboard, histogram) >= {0.5, 0.99}


def test_dashboard_shows_traffic_load_and_resources(dashboard: dict[str, Any]) -> None:
    exprs = [compact(e) for e in expressions(dashboard)]

    def shown(*parts: str) -> bool:
        return any(all(part in expr for part in parts) for expr in exprs)

    assert shown("sumby(code)(rate(tokenwire_requests_total{"), "request rate by status code"
    assert shown("rate(tokenwire_generated_tokens_total{"), "tokens per second"
    for gauge in ("tokenwire_active_streams", "tokenwire_queue_depth", "tokenwire_batch_size"):
        assert shown(f"{gauge}{{"), gauge
    assert shown("tokenwire_kv_cache_tokens_reserved{", "/", "tokenwire_kv_cache_tokens_budget{"), "KV cache"
    assert shown("tokenwire_gpu_memory_allocated_bytes{", "/", "tokenwire_gpu_memory_total_bytes{")
    assert shown("tokenwire_gpu_memory_used_bytes{", "/", "tokenwire_gpu_memory_total_bytes{")
    assert shown("tokenwire_gpu_utilization_ratio{"), "GPU utilisation"
    assert shown('code="RESOURCE_EXHAUSTED"', "rate(tokenwire_requests_total{"), "refusals"
    assert shown("rate(tokenwire_deadline_refusals_total{"), "deadline refusals"
    assert shown("tokenwire_ready{"), "ready replicas"
    # the per-tenant row
    assert shown("sumby(tenant)(rate(tokenwire_tenant_tokens_total{", 'kind="completion"'), "tokens per tenant"
    assert shown("sumby(tenant,priority)(tokenwire_tenant_active_streams{"), "active streams per tenant"
    assert shown("sumby(tenant,priority)(tokenwire_tenant_queue_depth{"), "queued per tenant"
    assert shown("sumby(tenant,limit)(rate(tokenwire_tenant_refusals_total{"), "refusals per tenant and limit"
    assert quantiles_of(dashboard, "tokenwire_tenant_time_to_first_token_seconds") >= {0.5, 0.99}


# --- the alerts ------------------------------------------------------------------

# Each alert the kit must have: a part of its expression and its `for`.
EXPECTED_ALERTS = {
    "TokenwireServerErrorRatioHigh": (
        ['code=~"INTERNAL|UNKNOWN', "/sumby(namespace)(rate(tokenwire_requests_total[5m]))"], None
    ),
    "TokenwireTimeToFirstTokenHigh": (
        ["histogram_quantile(0.99,", "tokenwire_time_to_first_token_seconds_bucket", ">2"], None
    ),
    "TokenwireQueueSaturated": (["tokenwire_queue_depth/tokenwire_max_queue_depth>0.9"], "5m"),
    "TokenwireReplicaNotReady": (["tokenwire_ready==0"], "5m"),
    "TokenwireKVCacheBudgetExhausted": (
        ["tokenwire_kv_cache_tokens_reserved/tokenwire_kv_cache_tokens_budget>0.95"], "10m"
    ),
    "TokenwireGPUMemoryNearFull": (
        [
            "tokenwire_gpu_memory_allocated_bytes/tokenwire_gpu_memory_total_bytes>0.95",
            "tokenwire_gpu_memory_used_bytes/tokenwire_gpu_memory_total_bytes>0.95",
        ],
        None,
    ),
}  # fmt: skip


def test_every_rule_is_a_complete_alert(monitoring: Objects, rules: list[dict[str, Any]]) -> None:
    (rule,) = only(monitoring, "PrometheusRule")
    assert rule["spec"]["groups"], "no rule groups"
    for group in rule["spec"]["groups"]:
        assert group["name"] and group["rules"], group
    names = [r.get("alert") for r in rules]
    assert all(names) and len(names) == len(set(names)), f"unnamed or repeated alerts: {names}"
    for alert in rules:
        assert set(alert) == {"alert", "expr", "for", "labels", "annotations"}, alert["alert"]
        assert promql_metric_names(alert["expr"]) or "up{" in alert["expr"], alert["alert"]
        assert DURATION.match(alert["for"]), alert["alert"]
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}, alert["alert"]
        annotations = alert["annotations"]
        assert {"summary", "description", "runbook_url"} <= set(annotations), alert["alert"]
        assert annotations["summary"].strip() and annotations["description"].strip(), alert["alert"]
        assert re.match(r"^https?://\S+/docs/operations\.md#[a-z0-9-]+$", annotations["runbook_url"])


@pytest.mark.parametrize("name", sorted(EXPECTED_ALERTS))
def test_alert_watches_what_it_says(rules: list[dict[str, Any]], name: str) -> None:
    (alert,) = [r for r in rules if r["alert"] == name]
    parts, duration = EXPECTED_ALERTS[name]
    for part in parts:
        assert part in compact(alert["expr"]), f"{name}: {part} not in {alert['expr']}"
    assert duration is None or alert["for"] == duration


# --- the scrape ------------------------------------------------------------------


@pytest.mark.parametrize("name", WORKLOADS)
def test_servicemonitor_scrapes_each_pod_once_on_the_metrics_port(
    monitoring: Objects, rendered: dict[str, Objects], name: str
) -> None:
    (monitor,) = only(monitoring, "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector and set(monitor["spec"]["selector"]) == {"matchLabels"}
    assert "namespaceSelector" not in monitor["spec"], "scrape the namespace it is applied to"
    (endpoint,) = monitor["spec"]["endpoints"]
    services = [
        s
        for s in only(rendered[name], "Service")
        if all(s["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())
    ]
    assert services, f"the ServiceMonitor selects no Service of {name}"
    scraped = [(s, p) for s in services for p in s["spec"]["ports"] if p["name"] == endpoint["port"]]
    # One Service with the port: through two, every pod would be scraped (and counted) twice.
    ((service, port),) = scraped
    assert service["spec"].get("clusterIP") != "None"
    assert (port["port"], port["targetPort"]) == (METRICS_PORT, "metrics")
    container_ports = {p["name"]: p["containerPort"] for p in server_container(rendered[name])["ports"]}
    assert container_ports[port["targetPort"]] == METRICS_PORT
    (deployment,) = only(rendered[name], "Deployment")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert endpoint["path"] == annotations["prometheus.io/path"] == "/metrics"
    assert DURATION.match(endpoint["interval"])
