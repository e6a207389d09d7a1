"""The controller's Prometheus endpoint: job state, generation, restarts, per-node/rank signals.

The leading controller updates these gauges from the job record and the agents' monitor
summaries each tick and serves them over HTTP (prometheus-client) on the address it is given
(transom.utils.net.bind_address: loopback for a single-machine job), never on every interface.
It has its own registry, so nothing else in the process leaks into the endpoint. It only
exports; it never decides, and it never reads what a client sends beyond the HTTP request.
"""

from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from transom.common.records import Anomaly, JobRecord, MonitorSummary
from transom.common.states import JobState

log = logging.getLogger("transom.exporter")


class MonitorExporter:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.state = Gauge(
            "transom_job_state", "1 for the job's current state", ["state"], registry=r
        )
        self.generation = Gauge("transom_generation", "current generation", registry=r)
        self.restarts = Gauge(
            "transom_restarts_used", "restarts used (one per incident)", registry=r
        )
        self.step = Gauge(
            "transom_rank_step", "newest step a rank finished", ["node", "rank"], registry=r
        )
        self.step_s = Gauge(
            "transom_rank_step_seconds", "median step time", ["node", "rank"], registry=r
        )
        self.compute_s = Gauge(
            "transom_rank_compute_seconds",
            "median compute time (step minus communication)",
            ["node", "rank"],
            registry=r,
        )
        self.tokens = Gauge(
            "transom_rank_tokens_per_second", "throughput", ["node", "rank"], registry=r
        )
        self.node_step_s = Gauge(
            "transom_node_step_seconds",
            "slowest rank's median step time on the node",
            ["node"],
            registry=r,
        )
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
        if self.port is None:
            return  # no endpoint, no reader: a thousand nodes' gauges are not worth setting
        for s in JobState:
            self.state.labels(s.value).set(1 if job.state is s else 0)
        self.generation.set(job.generation)
        self.restarts.set(job.restarts_used)
        for g in (self.step, self.step_s, self.compute_s, self.tokens, self.node_step_s):
            g.clear()
        for node, summary in summaries.items():
            if summary.generation != job.generation:
                continue
            times = []
            for rank, r in summary.ranks.items():
                for gauge, value in (
                    (self.step, r.step),
                    (self.step_s, r.step_s),
                    (self.compute_s, r.compute_s),
                    (self.tokens, r.tokens_per_s),
                ):
                    if value is not None:
                        gauge.labels(node, rank).set(value)
                if r.step_s is not None:
                    times.append(r.step_s)
            if times:
                self.node_step_s.labels(node).set(max(times))

    def count(self, anomaly: Anomaly) -> None:
        for node in anomaly.nodes or ["-"]:
            self.anomalies.labels(anomaly.type, node).inc()
