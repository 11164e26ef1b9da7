"""bench.tenk runs end to end at a tiny scale: rollouts against `sparring serve` (retail pack, Postgres +
Redis), the baseline and the many-rollouts phase, on one Redis and (where redis-server is installed) on a
local Redis Cluster with two workers. What is checked is that it works and reports, never how fast.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from bench import tenk

TINY = ["--rollouts", "12", "--baseline-rollouts", "3", "--duration", "2"]
TINY += ["--min-interval", "0.2", "--max-interval", "0.5", "--procs", "2"]


def _run(tmp_path: Path, modes: str) -> list[dict[str, Any]]:
    # The exit status also reflects the latency target, which a tiny run on a busy machine may miss.
    tenk.main([*TINY, "--modes", modes, "--results-dir", str(tmp_path)])
    (out,) = tmp_path.glob("tenk-*.json")
    modes_run: list[dict[str, Any]] = json.loads(out.read_text())["modes"]
    return modes_run


def _check(result: dict[str, Any], workers: int) -> None:
    assert result["workers"] == workers
    base, many, again = result["baseline"], result["many"], result["baseline_after"]
    for phase, rollouts in ((base, 3), (many, 12), (again, 3)):
        assert phase["rollouts"] == rollouts
        assert phase["errors"] == 0, phase["not_2xx"]
        assert phase["first_calls"] == rollouts  # every rollout started with its task's item
        assert phase["ok"] == phase["calls"] > rollouts  # more than one call each
        assert phase["measured_calls"] > 0 and phase["p99_ms"] >= phase["p50_ms"] > 0
        # The server's own time per call, read back from the call log: every phase's calls are logged.
        assert phase["server_own_p99_ms"] >= phase["server_own_p50_ms"] > 0
    assert base["pg_connections_max"] >= 1 and many["pg_connections_max"] >= 1
    # Each rollout left its keys in Redis: meta and state at least, one ledger entry per call.
    assert many["redis_keys_per_rollout"] >= 2
    assert many["redis_key_bytes_per_rollout"] > 0
    assert many["rss_mb_after"] > 0 and result["workers_needed"] >= 1


def test_tenk_on_one_redis(tmp_path: Path) -> None:
    (result,) = _run(tmp_path, "single")
    _check(result, workers=1)


@pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
    reason="needs redis-server and redis-cli (Debian's redis-server package)",
)
def test_tenk_on_a_redis_cluster_with_two_workers(tmp_path: Path) -> None:
    (result,) = _run(tmp_path, "cluster")
    assert result["redis"] == "cluster of 3 shards"
    _check(result, workers=2)
