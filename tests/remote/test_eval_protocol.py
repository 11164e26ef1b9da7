"""eval-protocol 0.3.33's own RemoteRolloutProcessor and retry loop, unmodified, drive sparring.

The processor runs in its own interpreter (.venv-eval-protocol, built by `make install` from
eval_protocol_client/requirements.txt: eval-protocol cannot share sparring's virtualenv) and drives
a sparring served on loopback. Its model and tracing gateway are the scripted `ModelServer`, which
the driver first checks against eval-protocol's own logging handler and log reader. The processor
sends no key, so sparring serves it on an open, secret prefix.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.main import create_app
from app.remote.schemas import trace_id_for
from tests.conftest import make_settings
from tests.packs import counter_pack, faults_pack
from tests.remote.model_server import ModelServer
from tests.remote.served import serve
from tests.remote.test_remote_retries import ADDER, USER

CLIENT = Path(__file__).parent / "eval_protocol_client"
ROOT = Path(__file__).parents[2]
PREFIX = f"/remote/{uuid.uuid4().hex}"
RESULT = "driver-result: "

pytestmark = pytest.mark.parametrize("backend", ["real"], indirect=True)


def eval_protocol_python() -> str:
    """The interpreter of the eval-protocol virtualenv; a missing one fails the test, never skips it."""
    python = os.environ.get("SPARRING_EVAL_PROTOCOL_PYTHON") or str(ROOT / ".venv-eval-protocol/bin/python")
    if not Path(python).exists():
        pytest.fail(f"no eval-protocol interpreter at {python}: run `make install`", pytrace=False)
    return python


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    server = ModelServer()
    server.scripts["adder"] = ADDER
    server.scripts["flaky"] = ADDER
    server.start()
    yield server
    server.stop()


def sparring(tmp_path: Path, backend_settings: dict[str, Any], **overrides: Any) -> Any:
    """A sparring served on loopback whose remote routes the processor reaches without a key."""
    settings = make_settings(
        tmp_path / "home",
        **backend_settings,
        remote_open=True,
        remote_prefix=PREFIX,
        # eval-protocol turns only `http://localhost...` (or Fireworks') model URLs into gateway URLs.
        remote_allowed_hosts=["127.0.0.1", "localhost"],
        **overrides,
    )
    return serve(create_app(settings, packs=[counter_pack, faults_pack]))


def drive(url: str, server: ModelServer, tmp_path: Path, **args: Any) -> list[dict[str, Any]]:
    """Run the driver: eval-protocol's processor on one rollout (`runs` times over), its rows back."""
    arguments = {
        "remote": url + PREFIX,
        "gateway": f"http://localhost:{server.port}",
        "messages": USER,
        "timeout_seconds": 60,
        "max_tries": 3,
        "runs": 1,
        **args,
    }
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        # The trainer's key: eval-protocol sends it in the init and to its gateway.
        "FIREWORKS_API_KEY": "trainer-model-key",
        # litellm (imported by eval-protocol) would fetch its model prices from the internet.
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "NO_PROXY": "*",
    }
    done = subprocess.run(
        [eval_protocol_python(), str(CLIENT / "driver.py"), json.dumps(arguments)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    assert done.returncode == 0 and lines, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    result = json.loads(lines[-1].removeprefix(RESULT))
    # The stand-in gateway gave back what eval-protocol's own handler posted, as its reader reads it.
    check = result["gateway_check"]
    assert check["status"]["code"] == 13 and check["status"]["message"] == "handler check"
    assert check["logs"][0]["extras"]["k"] == 1
    rows: list[dict[str, Any]] = result["rows"]
    return rows


def remote_status(url: str, rollout_id: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}{PREFIX}/status", params={"rollout_id": rollout_id})
    assert answer.status_code == 200, answer.text
    status: dict[str, Any] = answer.json()
    return status


def gateway_codes(model: ModelServer, rollout_id: str) -> list[tuple[int, int]]:
    return [(log["status"]["code"], log["extras"]["attempt"]) for log in model.tagged(rollout_id)]


def tool_outputs(row: dict[str, Any]) -> list[str]:
    return [m["content"] for m in row["messages"] if m["role"] == "tool"]


def test_a_failed_first_attempt_succeeds_on_the_processors_retry_with_fresh_state(
    tmp_path: Path, backend_settings: dict[str, Any], model: ModelServer
) -> None:
    rollout_id = f"ep-{uuid.uuid4().hex[:12]}"
    with sparring(tmp_path, backend_settings) as url:
        [row] = drive(url, model, tmp_path, rollout_id=rollout_id, model="flaky")
        status = remote_status(url, rollout_id)
    # eval-protocol read the first attempt's failure (14: it raised and retried), then the retry's end.
    assert row["status"]["code"] == 100, row["status"]
    assert row["extra"]["trace_id"] == trace_id_for(rollout_id, 2) and row["extra"]["attempt"] == 2
    # The trace it loaded is the retry's, on a fresh state: 100 + 2 + 3 (the first attempt had added 2).
    assert tool_outputs(row)[:2] == ['{"value":102}', '{"value":105}']
    assert row["messages"][-1]["content"] == "The counter is 105."
    assert status["state"] == "finished" and status["attempt"] == 2
    [earlier] = status["info"]["earlier_attempts"]
    assert earlier["status_code"] == 14 and earlier["trace_id"] == trace_id_for(rollout_id)
    assert gateway_codes(model, rollout_id) == [(101, 1), (14, 1), (101, 2), (100, 2)]


def test_the_processors_init_of_a_finished_rollout_does_not_run_it_again(
    tmp_path: Path, backend_settings: dict[str, Any], model: ModelServer
) -> None:
    rollout_id = f"ep-{uuid.uuid4().hex[:12]}"
    with sparring(tmp_path, backend_settings) as url:
        first, again = drive(url, model, tmp_path, rollout_id=rollout_id, model="adder", runs=2)
        status = remote_status(url, rollout_id)
    assert first["status"]["code"] == again["status"]["code"] == 100
    assert tool_outputs(again) == tool_outputs(first)
    assert status["attempt"] == 1 and status["info"]["tool_calls"] == 3
    assert sum(1 for p in model.prefixes if f"/rollout_id/{rollout_id}/" in f"/{p}/") == 3
    # No RUNNING for the second init: the processor read the finished end at once.
    assert gateway_codes(model, rollout_id) == [(101, 1), (100, 1)]


def test_the_deadline_stops_a_rollout_and_the_processor_reads_it(
    tmp_path: Path, backend_settings: dict[str, Any], model: ModelServer
) -> None:
    rollout_id = f"ep-{uuid.uuid4().hex[:12]}"
    with sparring(tmp_path, backend_settings, remote_deadline_seconds=1) as url:
        [row] = drive(
            url, model, tmp_path, rollout_id=rollout_id, model="stall", max_tries=1, timeout_seconds=30
        )
        status = remote_status(url, rollout_id)
    # sparring stopped each attempt and told the gateway (4); the processor retried once, then gave up
    # with sparring's reason, not its own timeout.
    assert "SPARRING_REMOTE_DEADLINE_SECONDS" in row["status"]["message"], row["status"]
    assert status["state"] == "error" and status["status"]["code"] == 4 and status["attempt"] == 2
    assert [e["status_code"] for e in status["info"]["earlier_attempts"]] == [4]
    assert gateway_codes(model, rollout_id) == [(101, 1), (4, 1), (101, 2), (4, 2)]
