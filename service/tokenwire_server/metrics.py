"""Prometheus metrics, served on their own HTTP port (``--metrics-port``).

Names follow Prometheus conventions with base units (seconds, bytes, ratios).
Gauges that describe the engine are read at scrape time from ``EngineStats``.
GPU gauges exist only where there is a GPU: torch's memory counters on CUDA, and
NVML's utilisation and memory when ``nvidia-ml-py`` is installed (the ``gpu``
extra); elsewhere those families are simply not exported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .domain import EngineStats

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
_STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# Exported only on a CUDA host (torch) or where NVML is available: the dashboard and
# the alert rules may use these although a CPU server does not export them.
CUDA_METRIC_NAMES = (
    "tokenwire_gpu_memory_allocated_bytes",
    "tokenwire_gpu_memory_reserved_bytes",
    "tokenwire_gpu_memory_total_bytes",
)
NVML_METRIC_NAMES = ("tokenwire_gpu_utilization_ratio", "tokenwire_gpu_memory_used_bytes")

# device label -> (allocated, reserved, total) bytes
GpuMemoryProbe = Callable[[], Mapping[str, tuple[int, int, int]]]
# device label -> (utilisation 0..1, used bytes)
GpuUtilisationProbe = Callable[[], Mapping[str, tuple[float, int]]]


class _TenantCollector(Collector):
    """Active and queued requests per tenant and priority, read from ``EngineStats`` at scrape time."""

    def __init__(self) -> None:
        self.stats: Callable[[], EngineStats] | None = None  # set once an engine runs (``Metrics.watch``)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["tenant", "priority"]
        active = GaugeMetricFamily(
            "tokenwire_tenant_active_streams", "Requests generating now, per tenant and priority", labels=labels
        )
        queued = GaugeMetricFamily(
            "tokenwire_tenant_queue_depth", "Requests waiting for a slot, per tenant and priority", labels=labels
        )
        for load in self.stats().tenants if self.stats is not None else ():
            active.add_metric([load.tenant, load.priority], load.active)
            queued.add_metric([load.tenant, load.priority], load.queued)
        yield from (active, queued)


class _GpuCollector(Collector):
    def __init__(self, memory: GpuMemoryProbe | None, utilisation: GpuUtilisationProbe | None) -> None:
        self._memory = memory
        self._utilisation = utilisation

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self._memory is not None:
            allocated = GaugeMetricFamily(CUDA_METRIC_NAMES[0], "GPU memory held by tensors (torch)", labels=["device"])
            reserved = GaugeMetricFamily(
                CUDA_METRIC_NAMES[1], "GPU memory reserved by torch's allocator", labels=["device"]
            )
            total = GaugeMetricFamily(CUDA_METRIC_NAMES[2], "GPU memory on the device", labels=["device"])
            for device, (a, r, t) in self._memory().items():
                allocated.add_metric([device], a)
                reserved.add_metric([device], r)
                total.add_metric([device], t)
            yield from (allocated, reserved, total)
        if self._utilisation is not None:
            busy = GaugeMetricFamily(
                NVML_METRIC_NAMES[0], "GPU busy fraction over the last sample (NVML)", labels=["device"]
            )
            used = GaugeMetricFamily(NVML_METRIC_NAMES[1], "GPU memory used by all processes (NVML)", labels=["device"])
            for device, (u, m) in self._utilisation().items():
                busy.add_metric([device], u)
                used.add_metric([device], m)
            yield from (busy, used)


def nvml_probe() -> GpuUtilisationProbe | None:
    """NVML's view of every GPU, when ``nvidia-ml-py`` is installed and a driver answers."""
    try:
        import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]

        pynvml.nvmlInit()
        count = int(pynvml.nvmlDeviceGetCount())
    except Exception:  # not installed, no driver, no GPU: no NVML gauges
        return None

    def probe() -> dict[str, tuple[float, int]]:
        out: dict[str, tuple[float, int]] = {}
        for i in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            out[f"cuda:{i}"] = (float(rates.gpu) / 100.0, int(memory.used))
        return out

    return probe


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tokenwire_requests", "Finished calls by method and gRPC status code", ["method", "code"], registry=r
        )
        self.ttft = Histogram(
            "tokenwire_time_to_first_token_seconds",
            "Arrival to first streamed text",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tokenwire_inter_token_latency_seconds", "Gap between streamed chunks", buckets=_ITL_BUCKETS, registry=r
        )
        self.latency = Histogram(
            "tokenwire_request_duration_seconds",
            "Arrival to end of call",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "tokenwire_queue_wait_seconds", "Arrival to admission into the engine", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.prefill_step_seconds = Histogram(
            "tokenwire_prefill_step_seconds",
            "Time of one engine step that reads prompt tokens",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.decode_step_seconds = Histogram(
            "tokenwire_decode_step_seconds",
            "Time of one engine decode step over the batch",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.step_host_seconds = Histogram(
            "tokenwire_decode_step_host_seconds",
            "Host time of one decode step (batched engine): its wall time, delivery included, less the time computing"
            " the forward pass (CPU) or waiting for the device (CUDA)",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.generated_tokens = Counter("tokenwire_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("tokenwire_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.prefix_hit_tokens = Counter(
            "tokenwire_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache (not read again)", registry=r
        )
        self.resumes = Counter(
            "tokenwire_resumed_requests", "Generate calls that resume a cut stream (GenerateRequest.resume)", registry=r
        )
        self.handoffs = Counter(
            "tokenwire_handed_off_streams",
            "Streams ended UNAVAILABLE by a drain's hand-off, for their clients to resume on another replica",
            registry=r,
        )
        self.constrained = Counter(
            "tokenwire_constrained_requests",
            "Generate calls with a response format (constrained decoding), by format",
            ["format"],
            registry=r,
        )
        self.grammar_compile = Histogram(
            "tokenwire_grammar_compile_seconds",
            "Time to compile a response format the cache did not hold, by format",
            ["format"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.cancelled = Counter(
            "tokenwire_cancelled_requests", "Generate calls that ended CANCELLED (the client left)", registry=r
        )
        self.deadline_refusals = Counter(
            "tokenwire_deadline_refusals",
            "Generate calls refused at arrival because they could not start before their deadline",
            registry=r,
        )
        # Per tenant: label values are the configured tenants (--tenant-config, --auth-token-file).
        self.tenant_refusals = Counter(
            "tokenwire_tenant_refusals",
            "Calls refused RESOURCE_EXHAUSTED for a tenant's own limit, "
            "by limit (max_active, max_queued, tokens_per_minute)",
            ["tenant", "limit"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "tokenwire_tenant_tokens",
            "Prompt and completion tokens of finished calls, per tenant and priority",
            ["tenant", "priority", "kind"],
            registry=r,
        )
        # Per LoRA adapter: label values are the adapters loaded (--lora, LoadAdapter; at most
        # --max-loras at once) and those unloaded with streams left; an adapter's series go
        # after it is unloaded and its last stream ends (``forget_adapter``).
        self.adapter_tokens = Counter(
            "tokenwire_adapter_tokens",
            "Completion tokens of finished calls that named a LoRA adapter, per adapter",
            ["adapter"],
            registry=r,
        )
        self.adapter_streams = Gauge(
            "tokenwire_adapter_active_streams",
            "Streams in flight (queued or generating) that named a LoRA adapter, per adapter",
            ["adapter"],
            registry=r,
        )
        self.tenant_preemptions = Counter(
            "tokenwire_tenant_preemptions",
            "Running streams that gave their slot to a more urgent or fairer one "
            "and were queued again (batched engine)",
            ["tenant"],
            registry=r,
        )
        self.parks = Counter(
            "tokenwire_stream_parks",
            "Times a stream left its slot (and KV blocks) because its reader left --stream-backlog-chunks chunks "
            "unread; it comes back, with the same tokens, once the reader catches up (batched and simple engines)",
            ["tenant"],
            registry=r,
        )
        self.stalled_readers = Counter(
            "tokenwire_stalled_reader_streams",
            "Streams ended ABORTED because their reader read nothing for --stalled-reader-timeout while the stream "
            "waited for it (or too many streams waited at once)",
            ["tenant"],
            registry=r,
        )
        self.tenant_ttft = Histogram(
            "tokenwire_tenant_time_to_first_token_seconds",
            "Arrival to first streamed text, per tenant and priority",
            ["tenant", "priority"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._tenant_loads = _TenantCollector()
        r.register(self._tenant_loads)
        self.active = Gauge("tokenwire_active_streams", "Requests generating now", registry=r)
        self.queued = Gauge("tokenwire_queue_depth", "Requests waiting for a slot", registry=r)
        self.batch = Gauge("tokenwire_batch_size", "Sequences in the current decode batch", registry=r)
        self.parked_streams = Gauge(
            "tokenwire_parked_streams",
            "Streams out of the batch until their readers catch up: holding no slot, KV blocks or queue place",
            registry=r,
        )
        self.max_active = Gauge(
            "tokenwire_max_active_streams", "Most streams generating at once (--max-active)", registry=r
        )
        self.max_queue = Gauge("tokenwire_max_queue_depth", "Most requests that may wait (--max-queue)", registry=r)
        self.kv_reserved = Gauge(
            "tokenwire_kv_cache_tokens_reserved",
            "KV-cache tokens held or promised by admitted requests (their worst case, in whole blocks)",
            registry=r,
        )
        self.kv_budget = Gauge(
            "tokenwire_kv_cache_tokens_budget", "KV-cache budget in tokens (--kv-cache-tokens)", registry=r
        )
        self.ready = Gauge("tokenwire_ready", "1 while readiness is SERVING", registry=r)
        self.live = Gauge("tokenwire_live", "1 while liveness is SERVING", registry=r)
        self._http: Any = None

    # EngineObserver: what the engine reports as it works.
    def admitted(self, queue_wait_s: float) -> None:
        self.queue_wait.observe(queue_wait_s)

    def prefill_step(self, seconds: float, tokens: int = 0) -> None:
        self.prefill_step_seconds.observe(seconds)

    def decode_step(self, seconds: float) -> None:
        self.decode_step_seconds.observe(seconds)

    def step_host(self, seconds: float) -> None:
        self.step_host_seconds.observe(seconds)

    def preempted(self, tenant: str) -> None:
        self.tenant_preemptions.labels(tenant).inc()

    def parked(self, tenant: str) -> None:
        self.parks.labels(tenant).inc()

    def reader_stalled(self, tenant: str) -> None:
        self.stalled_readers.labels(tenant).inc()

    def watch(self, stats: Callable[[], EngineStats], max_active: int, max_queue: int) -> None:
        """Read the engine's gauges from ``stats`` at every scrape."""
        self.active.set_function(lambda: stats().active)
        self.queued.set_function(lambda: stats().queued)
        self.batch.set_function(lambda: stats().batch_size)
        self.parked_streams.set_function(lambda: stats().parked)
        self.kv_reserved.set_function(lambda: stats().kv_tokens_reserved)
        self.kv_budget.set_function(lambda: stats().kv_tokens_budget)
        self.max_active.set(max_active)
        self.max_queue.set(max_queue)
        self._tenant_loads.stats = stats

    def gauge_function(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """An engine-specific gauge read at every scrape (e.g. vLLM's own KV-cache usage)."""
        Gauge(name, help_text, registry=self.registry).set_function(read)

    def adapter_names(self) -> set[str]:
        """The adapters with a metric series now."""
        return {
            sample.labels["adapter"]
            for metric in (self.adapter_tokens, self.adapter_streams)
            for family in metric.collect()
            for sample in family.samples
        }

    def forget_adapter(self, name: str) -> None:
        """Drop ``name``'s series: it is unloaded and none of its streams is left (the label
        values stay bounded by what is loaded, whatever is loaded and unloaded over time)."""
        self.adapter_tokens.remove(name)
        self.adapter_streams.remove(name)

    def watch_gpu(self, memory: GpuMemoryProbe | None, utilisation: GpuUtilisationProbe | None) -> None:
        """Export GPU gauges from these probes (either may be None: its gauges are left out)."""
        if memory is not None or utilisation is not None:
            self.registry.register(_GpuCollector(memory, utilisation))

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Start the HTTP endpoint; return the bound port (port 0 picks a free one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return int(server.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
