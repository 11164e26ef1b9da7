"""Prometheus metrics; with several workers they aggregate through PROMETHEUS_MULTIPROC_DIR."""

from __future__ import annotations

import os
import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
SCORE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0)
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


class Metrics:
    """One set of metrics per app (not module globals), so several apps in one process stay apart."""

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        # prometheus_client picks its multi-process value store from PROMETHEUS_MULTIPROC_DIR itself;
        # Settings.metrics_dir reads the same variable so exposition aggregates the same files.
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.tool_calls = Counter(
            "sparring_tool_calls",
            "Tool calls answered, by tool and outcome class.",
            ["tool", "outcome"],
            registry=r,
        )
        self.tool_latency = Histogram(
            "sparring_tool_call_seconds", "Tool call latency.", ["tool"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.in_flight = self._live_total("sparring_tool_calls_in_flight", "Tool calls being answered.")
        self.ledger_replays = Counter(
            "sparring_ledger_replays",
            "Retried calls answered from the ledger without running the tool.",
            registry=r,
        )
        self.log_batch_size = Histogram(
            "sparring_log_batch_size",
            "Calls committed per call-log transaction.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.log_queue_depth = self._live_total(
            "sparring_log_queue_depth", "Call-log rows waiting for a commit."
        )
        self.grades = Counter(
            "sparring_grades", "Grades, by grader and status.", ["grader", "status"], registry=r
        )
        self.grade_score = Histogram(
            "sparring_grade_score", "Scores given, by grader.", ["grader"], buckets=SCORE_BUCKETS, registry=r
        )
        self.flags = Counter("sparring_flags", "Review flags raised at grade time.", ["flag"], registry=r)
        self.trace_spans_dropped = Counter(
            "sparring_trace_spans_dropped",
            "Spans lost before reaching the OTLP collector (its queue full, or the export failed).",
            registry=r,
        )

    def _live_total(self, name: str, documentation: str) -> Gauge:
        """A gauge that counts something in progress: with several workers, the live workers' sum."""
        return Gauge(name, documentation, registry=self.registry, multiprocess_mode="livesum")

    def exposition(self) -> bytes:
        if self.multiprocess_dir:
            _forget_dead_workers(self.multiprocess_dir)
            aggregate = CollectorRegistry()
            MultiProcessCollector(aggregate, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]
            return generate_latest(aggregate)
        return generate_latest(self.registry)


_LIVE_GAUGE_FILE = re.compile(r"^gauge_live[a-z]*_(\d+)\.db$")


def _forget_dead_workers(directory: str) -> None:
    """Drop the live-worker gauges of processes that are gone (a worker killed, and replaced by uvicorn):
    what they had in progress is not in progress any more. Their counters stay."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for pid in {int(m.group(1)) for m in map(_LIVE_GAUGE_FILE.match, names) if m}:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]
        except PermissionError:
            pass  # alive, under another user
