"""The controller's Prometheus endpoint: job state, generation, restarts, per-node/rank signals.

The leading controller hands it the job record and the agents' monitor summaries each tick
(`update`: two references kept, nothing computed) and the gauges are built from the newest of
them when the endpoint is read (a collector of its own registry): a tick costs nothing for
metrics nobody reads between two scrapes (it cost half the controller's tick when every tick
set a gauge for every rank). It serves over HTTP (prometheus-client) on the address it is given
(transom.utils.net.bind_address: loopback for a single-machine job), never on every interface.
Its registry is its own, so nothing else in the process leaks into the endpoint. It only
exports; it never decides, and it never reads what a client sends beyond the HTTP request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from transom.common.records import Anomaly, JobRecord, MonitorSummary
from transom.common.states import JobState

log = logging.getLogger("transom.exporter")

# Per-rank gauges: (name, help, the RankSummary field).
RANK_GAUGES = (
    ("transom_rank_step", "newest step a rank finished", "step"),
    ("transom_rank_step_seconds", "median step time", "step_s"),
    ("transom_rank_compute_seconds", "median compute time (step minus communication)", "compute_s"),
    ("transom_rank_tokens_per_second", "throughput", "tokens_per_s"),
)


class _JobCollector(Collector):
    """The job's gauges, built from the newest (job record, summaries) at each scrape."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.job: tuple[JobState, int, int] | None = None  # state, generation, restarts used
        self.summaries: dict[str, MonitorSummary] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self.lock:
            job, summaries = self.job, self.summaries
        if job is None:
            return
        job_state, generation, restarts_used = job
        state = GaugeMetricFamily(
            "transom_job_state", "1 for the job's current state", labels=["state"]
        )
        for s in JobState:
            state.add_metric([s.value], 1 if job_state is s else 0)
        yield state
        yield GaugeMetricFamily("transom_generation", "current generation", value=generation)
        yield GaugeMetricFamily(
            "transom_restarts_used", "restarts used (one per incident)", value=restarts_used
        )
        ranks = {
            name: GaugeMetricFamily(name, text, labels=["node", "rank"])
            for name, text, _ in RANK_GAUGES
        }
        node_step_s = GaugeMetricFamily(
            "transom_node_step_seconds",
            "slowest rank's median step time on the node",
            labels=["node"],
        )
        for node, summary in summaries.items():
            if summary.generation != generation:
                continue
            times = []
            for rank, r in summary.ranks.items():
                for name, _, field in RANK_GAUGES:
                    value = getattr(r, field)
                    if value is not None:
                        ranks[name].add_metric([node, rank], value)
                if r.step_s is not None:
                    times.append(r.step_s)
            if times:
                node_step_s.add_metric([node], max(times))
        yield from ranks.values()
        yield node_step_s


class MonitorExporter:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self._job = _JobCollector()
        r.register(self._job)
        self.anomalies = Counter(
            "transom_anomalies", "anomalies raised", ["type", "node"], registry=r
        )
        self.port: int | None = None
        self._server: WSGIServer | None = None

    def serve(self, port: int, host: str) -> int | None:
        """Start the HTTP endpoint on `host` (0: a free port); the port it listens on, or None
        if it cannot."""
        try:
            server, _ = start_http_server(port, addr=host, registry=self.registry)
            self._server, self.port = server, server.server_port
        except OSError as e:
            log.warning("metrics endpoint on port %s unavailable: %s", port, e)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def update(self, job: JobRecord, summaries: dict[str, MonitorSummary]) -> None:
        """The newest job record and summaries, for the next scrape (the summaries' dict is
        kept, not copied: the controller builds a new one for every tick)."""
        with self._job.lock:
            self._job.job = (job.state, job.generation, job.restarts_used)
            self._job.summaries = summaries

    def count(self, anomaly: Anomaly) -> None:
        for node in anomaly.nodes or ["-"]:
            self.anomalies.labels(anomaly.type, node).inc()
