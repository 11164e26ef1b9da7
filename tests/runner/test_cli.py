"""`sparring eval` and `sparring canary` as a user runs them: commands against a served sparring process
(retail pack, Postgres + Redis) and the scripted model server."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ADMIN_KEY, GRADER_KEY, REDIS_URL, TOOLS_KEY
from tests.retail.conftest import HOME
from tests.retail.corpus import build_dataset, gold_calls, replay
from tests.runner.model_server import ModelRequest, ModelServer, Reply, Unavailable
from tests.runner.test_retail import GoldModel, with_writes_and_facts
from tests.system.helpers import Server, Servers, clean_env, server_settings
from tools.retail import data

SPARRING = str(Path(sys.executable).with_name("sparring"))

WEAK_GRADERS = """
nonempty:
  type: string_check
  name: nonempty
  operation: ne
  input: "{{ sample.output_text }}"
  reference: ""
"""


@pytest.fixture(scope="module")
def retail_data() -> Path:
    return data.DATA.fetch(data.DATA.cache_dir(HOME))


@pytest.fixture(scope="module")
def train(retail_data: Path) -> list[dict[str, Any]]:
    return build_dataset("train")


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    started = Servers(tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


@pytest.fixture
async def sparring(servers: Servers, pg_database: str, retail_data: Path, tmp_path: Path) -> Server:
    graders = tmp_path / "graders.yaml"
    graders.write_text(WEAK_GRADERS, encoding="utf-8")
    settings = server_settings(
        database_url=pg_database,
        redis_url=REDIS_URL,
        home=tmp_path / "server-home",
        worker="runner-cli",
        SPARRING_PACKS="retail",
        SPARRING_RETAIL_DATA=str(retail_data),
        SPARRING_GRADERS_FILE=str(graders),
    )
    return await servers.start("retail", settings)


def write_lines(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


async def run_cli(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    settings = {
        "SPARRING_TOOLS_KEY": TOOLS_KEY,
        "SPARRING_GRADER_KEY": GRADER_KEY,
        "SPARRING_HOME": str(tmp_path / "client-home"),
        **env,
    }
    return await asyncio.to_thread(
        subprocess.run,
        [SPARRING, *args],
        env=clean_env(**settings),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


async def review(server: Server, path: str) -> Any:
    async with httpx.AsyncClient(
        base_url=server.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ) as client:
        response = await client.get(path)
    assert response.status_code == 200, response.text
    return response.json()


async def test_canary_on_the_train_split_passes_and_names_the_items_it_cannot_judge(
    sparring: Server, train: list[dict[str, Any]], tmp_path: Path
) -> None:
    dataset = write_lines(tmp_path / "retail-train.jsonl", train)
    done = await run_cli(
        tmp_path,
        "canary", "--dataset", str(dataset), "--server", sparring.url, "--grader", "retail",
        "--max-tool-calls", "5", "--run", "canary-cli", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    rows = {row["policy"]: row for row in report["policies"]}
    assert rows["gold"]["mean"] == 1.0 and rows["gold"]["graded"] == 72
    blind = sorted(
        f"task_id:{line['task_id']}"
        for line in train
        if not line["communicate_info"] and not any(replay(gold_calls(line["task_id"])).changes.values())
    )
    assert rows["loop"]["items_above_half"] == blind
    assert rows["loop"]["mean"] == pytest.approx(len(blind) / len(train))
    for name in ("empty", "refuse", "parrot", "guess"):
        assert rows[name]["mean"] == 0.0 and rows[name]["items_above_half"] == [], name
    # Outside the items it names, every rollout of a policy other than gold scored exactly 0.
    for rollout in report["rollouts"]:
        if rollout["policy"] != "gold" and rollout["item"] not in rows[rollout["policy"]]["items_above_half"]:
            assert rollout["score"] == 0.0, rollout
    assert rows["guess"]["rollouts"] == sum(1 for line in train if line["communicate_info"])
    assert report["failures"] == []
    # Each canary is a run of its own in the review pages.
    runs = {run["run"]: run["rollouts"] for run in await review(sparring, "/review/api/runs")}
    assert runs["canary-cli-gold"] == 72 and runs["canary-cli-empty"] == len(train)


async def test_canary_fails_loudly_on_a_grader_that_only_wants_a_non_empty_answer(
    sparring: Server, train: list[dict[str, Any]], tmp_path: Path
) -> None:
    dataset = write_lines(tmp_path / "some.jsonl", train[:6])
    done = await run_cli(
        tmp_path,
        "canary", "--dataset", str(dataset), "--server", sparring.url, "--grader", "nonempty",
        "--policy", "empty", "--policy", "refuse", "--policy", "parrot", "--policy", "gold", "--run", "weak",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL:" in done.stdout
    assert (
        "refuse averages 1.000 >= 0.2: the grader can be gamed (let through by nonempty); fix: "
        in done.stdout
    )
    assert "parrot averages 1.000 >= 0.2" in done.stdout
    assert "empty averages" not in done.stdout  # "" is the one answer this grader refuses
    assert "refuse scored above 0.5 on: task_id:" in done.stdout


@pytest.mark.parametrize("how", ["server", "job-config"])
async def test_eval_against_an_openai_compatible_server_matches_the_review_api(
    how: str,
    sparring: Server,
    model_server: ModelServer,
    train: list[dict[str, Any]],
    tmp_path: Path,
) -> None:
    raw = with_writes_and_facts(train, 2)
    model_server.script = GoldModel(raw, immediate={raw[1]["task_id"]: {1}})
    dataset = write_lines(tmp_path / "two.jsonl", raw)
    run = f"baseline-{how}"
    if how == "server":
        where = ["--server", sparring.url, "--grader", "retail", "--api", "chat"]
    else:
        config = await run_cli(
            tmp_path, "job-config", "--base-url", sparring.url, "--grader", "retail", "--allow-http",
            SPARRING_PACKS="retail", SPARRING_RETAIL_DATA=str(HOME / "packs" / "retail"),
        )  # fmt: skip
        assert config.returncode == 0, config.stderr
        (tmp_path / "job.json").write_text(config.stdout, encoding="utf-8")
        where = ["--job-config", str(tmp_path / "job.json"), "--api", "responses"]
    done = await run_cli(
        tmp_path,
        "eval", "--dataset", str(dataset), "--model", "scripted", "--base-url", model_server.base_url,
        *where, "--run", run, "--samples", "2", "--out", str(tmp_path / "report.json"),
        "--export", str(tmp_path / "export.jsonl"),
        OPENAI_API_KEY="test-key",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    # One item passes both times, the other once: pass@2 is 1, pass^2 a half; errors clustered by item.
    assert report["reward"]["stderr"] == pytest.approx(0.25)
    assert [(r["k"], r["pass_at_k"], r["pass_hat_k"]) for r in report["pass"]["by_k"]] == [
        (1, 0.75, 0.75),
        (2, 1.0, 0.5),
    ]
    assert "mean reward        0.750 ± 0.250" in done.stdout
    exported = [json.loads(line) for line in (tmp_path / "export.jsonl").read_text().splitlines()]
    assert {(row["run"], row["model"]) for row in exported} == {(run, "scripted")}
    assert sorted((row["score"], row["passed"]) for row in exported) == [(0.0, False)] + [(1.0, True)] * 3
    assert [row["sample"] for row in exported] == [0, 1, 0, 1]
    assert ["review", f"{sparring.url}/review/run?name={run}"] in [
        line.split() for line in done.stdout.splitlines()
    ]
    assert report["rollouts"]["graded"] == 4
    assert report["reward"]["mean"] == pytest.approx(0.75)
    stats = await review(sparring, f"/review/api/stats?run={run}")
    assert stats["reward"]["scored"] == 4
    assert stats["reward"]["mean"] == pytest.approx(report["reward"]["mean"])
    assert stats["reward"]["std"] == pytest.approx(report["reward"]["std"])
    assert stats["items"]["share_always_one"] == pytest.approx(report["items"]["share_always_one"]) == 0.5


async def test_eval_run_again_under_its_label_exports_the_rollouts_it_reports(
    sparring: Server, model_server: ModelServer, train: list[dict[str, Any]], tmp_path: Path
) -> None:
    dataset = write_lines(tmp_path / "one.jsonl", train[:1])
    export = tmp_path / "export.jsonl"
    args = [
        "eval", "--dataset", str(dataset), "--model", "scripted", "--base-url", model_server.base_url,
        "--api", "chat", "--server", sparring.url, "--grader", "nonempty", "--run", "again",
        "--samples", "2", "--out", str(tmp_path / "report.json"), "--export", str(export),
    ]  # fmt: skip
    # The same command twice (no --resume): an empty answer scores 0, then a fixed model scores 1.
    runs = []
    for answer in ("", "Done."):
        model_server.script = lambda request, answer=answer: Reply(text=answer)
        done = await run_cli(tmp_path, *args, OPENAI_API_KEY="test-key")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        report = json.loads((tmp_path / "report.json").read_text())
        runs.append((report, [json.loads(line) for line in export.read_text().splitlines()]))
    (first, first_rows), (second, second_rows) = runs
    assert first["reward"]["mean"] == 0.0 and second["reward"]["mean"] == 1.0
    assert [row["score"] for row in first_rows] == [0.0, 0.0]
    # The export of the second run holds its own rollouts, as its report counts them.
    assert [row["score"] for row in second_rows] == [1.0, 1.0]
    assert {row["trace_id"] for row in first_rows}.isdisjoint(row["trace_id"] for row in second_rows)


async def test_eval_refuses_a_wrong_key_before_calling_the_model(
    sparring: Server, model_server: ModelServer, train: list[dict[str, Any]], tmp_path: Path
) -> None:
    dataset = write_lines(tmp_path / "one.jsonl", train[:1])
    done = await run_cli(
        tmp_path,
        "eval", "--dataset", str(dataset), "--model", "m", "--base-url", model_server.base_url,
        "--server", sparring.url, "--grader", "retail",
        SPARRING_TOOLS_KEY="wrong",
    )  # fmt: skip
    assert done.returncode == 2
    assert "refused the tools key (HTTP 401): set SPARRING_TOOLS_KEY" in done.stderr
    assert model_server.requests == []
    unknown = await run_cli(
        tmp_path,
        "eval", "--dataset", str(dataset), "--model", "m", "--base-url", model_server.base_url,
        "--server", sparring.url, "--grader", "nope",
    )  # fmt: skip
    assert unknown.returncode == 2 and "has no grader 'nope'" in unknown.stderr
    no_pack = await run_cli(
        tmp_path,
        "eval", "--dataset", str(dataset), "--model", "m", "--base-url", model_server.base_url,
        "--server", sparring.url, "--grader", "retail", "--pack", "airline",
    )  # fmt: skip
    assert no_pack.returncode == 2 and "has no enabled pack named 'airline'" in no_pack.stderr
    (tmp_path / "job.json").write_text('{"tools": [{"name": "t", "server_url": "http://x"}]}')
    with_config = await run_cli(
        tmp_path,
        "canary", "--dataset", str(dataset), "--job-config", str(tmp_path / "job.json"), "--pack", "retail",
    )  # fmt: skip
    assert with_config.returncode == 2 and "a job config's tools carry their own routes" in with_config.stderr
    assert model_server.requests == []


async def test_ctrl_c_prints_what_was_done_and_resume_finishes_the_run(
    sparring: Server, model_server: ModelServer, train: list[dict[str, Any]], tmp_path: Path
) -> None:
    raw = with_writes_and_facts(train, 2)
    gold = GoldModel(raw)

    def slow(request: ModelRequest) -> Reply:
        time.sleep(0.2)  # a model that takes its time: the run is still going when Ctrl-C comes
        return gold(request)

    model_server.script = slow
    dataset = write_lines(tmp_path / "two.jsonl", raw)
    args = [
        "eval", "--dataset", str(dataset), "--model", "scripted", "--base-url", model_server.base_url,
        "--server", sparring.url, "--grader", "retail", "--api", "chat", "--run", "interrupted",
        "--samples", "3", "--concurrency", "1",
    ]  # fmt: skip
    env = clean_env(
        SPARRING_TOOLS_KEY=TOOLS_KEY,
        SPARRING_GRADER_KEY=GRADER_KEY,
        SPARRING_HOME=str(tmp_path / "client-home"),
    )
    journal = tmp_path / "client-home" / "runs" / "interrupted.jsonl"
    proc = await asyncio.create_subprocess_exec(
        SPARRING, *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 120
        while not (journal.exists() and journal.read_text().count("\n") >= 1):
            assert proc.returncode is None, await proc.communicate()
            assert time.monotonic() < deadline, "no rollout finished"
            await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    stdout, stderr = out.decode(), err.decode()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stdout and "--resume" in stdout
    first = [json.loads(line) for line in journal.read_text().splitlines()]
    assert 1 <= len(first) < 6

    model_server.script = gold
    done = await run_cli(tmp_path, *args, "--resume", "--out", str(tmp_path / "report.json"))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    graded_before = sum(1 for record in first if record["discarded"] is None)
    assert report["rollouts"]["resumed"] == graded_before
    assert report["rollouts"]["graded"] == 6 and report["reward"]["mean"] == 1.0
    stats = await review(sparring, "/review/api/stats?run=interrupted")
    assert stats["reward"]["scored"] == 6


def refused_port() -> int:
    """A loopback port nothing listens on: connections to it are refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_eval_stops_at_the_preflight_when_the_model_endpoint_refuses_connections(
    sparring: Server, train: list[dict[str, Any]], tmp_path: Path
) -> None:
    dataset = write_lines(tmp_path / "one.jsonl", train[:2])
    base_url = f"http://127.0.0.1:{refused_port()}/v1"
    done = await run_cli(
        tmp_path,
        "eval", "--dataset", str(dataset), "--model", "m", "--base-url", base_url, "--api", "chat",
        "--server", sparring.url, "--grader", "retail", "--out", str(tmp_path / "report.json"),
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "the model failed its pre-flight call (m)" in done.stderr
    # A refused connection is a connection error, not a timeout.
    assert "APIConnectionError" in done.stderr and "APITimeoutError" not in done.stderr
    assert "timed out" not in done.stderr
    assert f"check: --base-url {base_url}: is a model server listening there?" in done.stderr
    assert not (tmp_path / "report.json").exists()  # no rollout was run


async def test_eval_preflight_names_the_api_and_base_url_on_a_404(
    sparring: Server, model_server: ModelServer, train: list[dict[str, Any]], tmp_path: Path
) -> None:
    dataset = write_lines(tmp_path / "one.jsonl", train[:1])
    base_url = model_server.base_url.replace("/v1", "/v2")  # no route there: a 404, as a wrong --api gets
    done = await run_cli(
        tmp_path,
        "eval", "--dataset", str(dataset), "--model", "m", "--base-url", base_url,
        "--server", sparring.url, "--grader", "retail",
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "NotFoundError" in done.stderr
    assert "check: --api responses: the endpoint has no /responses" in done.stderr
    assert "try --api chat" in done.stderr and f"--base-url {base_url}" in done.stderr
    assert model_server.requests == [] and model_server.preflights == []


async def test_eval_where_every_rollout_is_discarded_prints_the_reasons_and_exits_1(
    sparring: Server, model_server: ModelServer, train: list[dict[str, Any]], tmp_path: Path
) -> None:
    def down(request: ModelRequest) -> Reply:
        raise Unavailable  # the pre-flight passes; every rollout's model turn then gets a 503

    model_server.script = down
    dataset = write_lines(tmp_path / "two.jsonl", train[:2])
    done = await run_cli(
        tmp_path,
        "eval", "--dataset", str(dataset), "--model", "m", "--base-url", model_server.base_url,
        "--api", "chat", "--server", sparring.url, "--grader", "retail", "--samples", "2",
        OPENAI_API_KEY="test-key",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert len(model_server.preflights) == 1
    assert "error: no rollout could be graded: all 4 were discarded" in done.stderr
    lines = done.stdout.splitlines()
    grouped = lines[lines.index("discarded, by reason:") + 1 :]
    # One line for the one cause, with its count: the reason is on screen, not only in a file.
    assert len(grouped) == 1, grouped
    assert grouped[0].split()[0] == "4"
    assert "model_error: " in grouped[0] and "503" in grouped[0]


async def test_eval_max_discarded_fails_a_run_with_too_many_discards(
    sparring: Server, model_server: ModelServer, train: list[dict[str, Any]], tmp_path: Path
) -> None:
    raw = with_writes_and_facts(train, 2)
    gold = GoldModel(raw)
    broken = raw[0]["messages"][-1]["content"]

    def half(request: ModelRequest) -> Reply:
        if request.user == broken:
            raise Unavailable
        return gold(request)

    model_server.script = half
    dataset = write_lines(tmp_path / "two.jsonl", raw)
    args = [
        "eval", "--dataset", str(dataset), "--model", "m", "--base-url", model_server.base_url,
        "--api", "chat", "--server", sparring.url, "--grader", "retail",
    ]  # fmt: skip
    tolerated = await run_cli(tmp_path, *args, "--max-discarded", "50", OPENAI_API_KEY="k")
    assert tolerated.returncode == 0, tolerated.stdout + tolerated.stderr
    assert "discarded, by reason:" in tolerated.stdout
    strict = await run_cli(tmp_path, *args, "--max-discarded", "10", OPENAI_API_KEY="k")
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "3 of 6 rollouts (50.0%) were discarded, more than --max-discarded 10%" in strict.stderr


async def test_canary_where_no_rollout_can_be_graded_exits_1_with_the_reason(
    sparring: Server, train: list[dict[str, Any]], tmp_path: Path
) -> None:
    dataset = write_lines(tmp_path / "two.jsonl", train[:2])
    grader_url = f"http://127.0.0.1:{refused_port()}/grade/retail"
    done = await run_cli(
        tmp_path,
        "canary", "--dataset", str(dataset), "--server", sparring.url, "--grader-url", grader_url,
        "--policy", "empty",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "error: no rollout could be graded: all 2 were discarded" in done.stderr
    lines = done.stdout.splitlines()
    grouped = lines[lines.index("discarded, by reason:") + 1 :]
    assert grouped[0].split()[0] == "2" and "grader_failed" in grouped[0]
