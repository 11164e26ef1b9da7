"""What a remote rollout's caller and its model server can make sparring do is bounded: where it sends
requests, how long and how much it reads, and what it tells the caller when the model misbehaves.

No test here ever connects to an address other than loopback: refused destinations are refused before
any connection (the rule's own tests use address literals and a resolver they control), and the
model servers the rollouts reach listen on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from app.config import Settings
from app.remote.build import build_model_http
from app.remote.egress import EgressRule, GuardedTransport, RefusedDestination, is_public
from app.remote.runner import GatewayStatusLog
from app.remote.schemas import CODE_RUNNING, InitRequest, plan
from app.remote.service import status_of
from tests.conftest import AppFactory
from tests.grading.test_routes import GRADERS, write_graders
from tests.remote.model_server import SECRET, ModelServer, Turn
from tests.remote.processor import Row, init_request, post_init, wait_terminated

USER = [{"role": "user", "content": "Say done."}]
NOT_PUBLIC = [
    "10.0.0.1",
    "192.168.1.1",
    "172.16.5.4",
    "169.254.169.254",  # the cloud metadata service
    "100.100.100.200",  # Alibaba's metadata service, in the shared range
    "127.0.0.1",
    "0.0.0.0",
    "[::1]",
    "[fd00:ec2::254]",  # AWS's metadata service over IPv6
    "[fe80::1]",
    "[::ffff:169.254.169.254]",  # IPv4-mapped
    "[64:ff9b::a9fe:a9fe]",  # NAT64 of 169.254.169.254
    "[64:ff9b:1::a9fe:a9fe]",  # the same through a local-use NAT64 prefix (RFC 8215)
    "[2002:a9fe:a9fe::1]",  # 6to4 of 169.254.169.254
]


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    server = ModelServer()
    server.scripts["done"] = [Turn(text="done")]
    server.start()
    yield server
    server.stop()


class Unreachable(httpx2.AsyncBaseTransport):
    """Stands where the network would be: records what it was asked to send, sends nothing."""

    def __init__(self) -> None:
        self.sent: list[httpx2.Request] = []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        self.sent.append(request)
        return httpx2.Response(200, json={})


def resolver(table: dict[str, list[str]]) -> Any:
    async def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError(f"no address for {host}")
        return table[host]

    return resolve


@pytest.mark.parametrize("host", NOT_PUBLIC)
async def test_the_rule_refuses_every_non_public_address_before_connecting(host: str) -> None:
    network = Unreachable()
    client = httpx2.AsyncClient(transport=GuardedTransport(network, EgressRule()))
    with pytest.raises(RefusedDestination, match="non-public address"):
        await client.post(f"http://{host}:8080/v1/chat/completions", json={})
    with pytest.raises(RefusedDestination):
        await EgressRule().check(f"https://{host}/v1", "model base URL")
    assert network.sent == []


async def test_a_name_is_judged_by_what_it_resolves_to_and_connected_to_at_that_address() -> None:
    table = {"inside.example": ["203.0.113.9", "10.0.0.1"], "model.example": ["93.184.215.14"]}
    network = Unreachable()
    rule = EgressRule(resolve=resolver(table))
    client = httpx2.AsyncClient(transport=GuardedTransport(network, rule))
    # One private address among the answers is enough to refuse: the connection could pick it.
    with pytest.raises(RefusedDestination):
        await client.post("http://inside.example/v1/chat/completions", json={})
    assert network.sent == []

    await client.post("https://model.example/v1/chat/completions", json={})
    (sent,) = network.sent
    # Sent to the address that was checked, so a second lookup (DNS rebinding) cannot move it.
    assert sent.url.host == "93.184.215.14" and sent.url.scheme == "https"
    assert sent.headers["host"] == "model.example"
    assert sent.extensions["sni_hostname"] == "model.example"

    with pytest.raises(RefusedDestination, match="does not resolve"):
        await client.post("http://nowhere.example/v1", json={})


async def test_listed_hosts_pass_by_name_or_by_address() -> None:
    table = {"gpu-box.internal": ["10.1.2.3"], "localhost": ["127.0.0.1"]}
    rule = EgressRule(["gpu-box.internal", "127.0.0.1"], resolve=resolver(table))
    assert await rule.address_for("gpu-box.internal", 80, "model base URL") is None  # trusted by name
    assert await rule.address_for("localhost", 80, "model base URL") == "127.0.0.1"  # by its address
    with pytest.raises(RefusedDestination):
        await rule.address_for("127.0.0.2", 80, "model base URL")


def test_addresses_on_the_internet_are_public() -> None:
    import ipaddress

    assert is_public(ipaddress.ip_address("93.184.215.14"))
    assert is_public(ipaddress.ip_address("2606:4700::1111"))
    assert not is_public(ipaddress.ip_address("224.0.0.1"))  # multicast


async def test_credentials_in_a_url_are_refused() -> None:
    with pytest.raises(RefusedDestination, match="credentials"):
        await EgressRule(["127.0.0.1"]).check("http://user:pw@127.0.0.1:9/v1", "model base URL")


async def test_init_refuses_loopback_and_credentials_unless_the_operator_lists_the_host(
    app_factory: AppFactory, model: ModelServer
) -> None:
    """Only loopback is ever dialled here; non-public addresses of other kinds are the rule's tests."""
    port = model.port
    reached = len(model.prefixes)
    async with app_factory(remote_allowed_hosts=[]) as client:
        for url in (
            f"http://127.0.0.1:{port}/v1",
            f"http://localhost:{port}/v1",
            f"http://[::1]:{port}/v1",
            f"http://127.1:{port}/v1",
        ):
            row = Row.new()
            answer = await client.post(
                "/remote/init", json=init_request(row, model="done", model_base_url=url, messages=USER)
            )
            assert answer.status_code == 400, (url, answer.text)
            assert answer.json()["error"]["code"] == "bad_request"
            unknown = await client.get("/remote/status", params={"rollout_id": row.rollout_id})
            assert unknown.status_code == 404  # nothing was started
    assert len(model.prefixes) == reached  # the model server never heard of them

    async with app_factory(remote_allowed_hosts=["localhost"]) as client:
        # The model host is listed by name; the status log's 127.0.0.1 is not.
        row = Row.new()
        body = init_request(
            row,
            model="done",
            model_base_url=f"http://localhost:{port}/v1",
            messages=USER,
            status_log_url=f"http://127.0.0.1:{port}/logs",
        )
        answer = await client.post("/remote/init", json=body)
        assert answer.status_code == 400 and "status log URL" in answer.json()["error"]["message"]
        body["model_base_url"] = f"http://user:secret@localhost:{port}/v1"
        del body["status_log_url"]
        answer = await client.post("/remote/init", json=body)
        assert answer.status_code == 400 and "credentials" in answer.json()["error"]["message"]
        body["model_base_url"] = f"http://localhost:{port}/v1"
        assert (await post_init(client, "/remote", body)).status_code == 200
        assert (await wait_terminated(client, "/remote", row.rollout_id))["state"] == "finished"


async def test_the_model_client_does_not_follow_a_redirect(model: ModelServer) -> None:
    """A redirect is a new destination the caller chose: the remote's client answers it, never follows."""
    model.redirect_to = f"http://127.0.0.2:{model.port}/v1/chat/completions"
    http = build_model_http(Settings(remote_allowed_hosts=["127.0.0.1"], remote_model_timeout_seconds=5))
    try:
        answer = await http.post(f"{model.base_url()}/chat/completions", json={"model": "redirect"})
    finally:
        await http.aclose()
    assert answer.status_code == 307


async def test_the_model_servers_error_text_never_reaches_the_caller(
    app_factory: AppFactory, model: ModelServer
) -> None:
    row = Row.new()
    async with app_factory() as client:
        body = init_request(row, model="forbidden", model_base_url=model.base_url(), messages=USER)
        assert (await post_init(client, "/remote", body)).status_code == 200
        status = await wait_terminated(client, "/remote", row.rollout_id)
    assert status["state"] == "error" and status["status"]["code"] == 14
    assert status["reason"] == "model_error: the model endpoint answered HTTP 403"
    assert "hunter2" not in str(status) and SECRET not in str(status)


@pytest.mark.parametrize("name", ["garbage", "truncated", "keyed"])
async def test_a_model_answering_what_is_not_a_completion_is_a_model_error(
    app_factory: AppFactory, model: ModelServer, name: str
) -> None:
    row = Row.new()
    async with app_factory() as client:
        body = init_request(row, model=name, model_base_url=model.base_url(), messages=USER)
        assert (await post_init(client, "/remote", body)).status_code == 200
        status = await wait_terminated(client, "/remote", row.rollout_id)
    assert status["state"] == "error"
    assert status["status"]["code"] == 14  # the model's fault: UNAVAILABLE, never INTERNAL (13)
    assert status["reason"].startswith("model_error: the model endpoint answered something")


async def test_a_key_that_cannot_be_sent_and_a_client_parameter_are_not_internal_errors(
    app_factory: AppFactory, model: ModelServer
) -> None:
    accented, with_client = Row.new(), Row.new()
    async with app_factory() as client:
        body = init_request(accented, model="done", model_base_url=model.base_url(), messages=USER)
        body["api_key"] = "clé-du-modèle"
        assert (await post_init(client, "/remote", body)).status_code == 200
        body = init_request(with_client, model="done", model_base_url=model.base_url(), messages=USER)
        body["completion_params"]["client"] = "eval-protocol"
        assert (await post_init(client, "/remote", body)).status_code == 200
        key_status = await wait_terminated(client, "/remote", accented.rollout_id)
        client_status = await wait_terminated(client, "/remote", with_client.rollout_id)
    assert key_status["state"] == "error" and key_status["status"]["code"] == 14
    assert "API key" in key_status["reason"] and "not ASCII" in key_status["reason"]
    # `client` is a sampling parameter like any other: it goes to the model, which ignores it.
    assert client_status["state"] == "finished", client_status


async def test_a_stream_completion_parameter_does_not_turn_the_answers_into_an_event_stream(
    app_factory: AppFactory, model: ModelServer
) -> None:
    # eval-protocol's processors take `"stream": true` in completion_params; sparring reads whole answers.
    row = Row.new()
    async with app_factory() as client:
        body = init_request(row, model="done", model_base_url=model.base_url(), messages=USER)
        body["completion_params"]["stream"] = True
        assert (await post_init(client, "/remote", body)).status_code == 200
        status = await wait_terminated(client, "/remote", row.rollout_id)
    assert status["state"] == "finished", status
    assert status["info"]["final_text"] == "done"


async def test_the_extra_body_of_completion_params_reaches_the_model(
    app_factory: AppFactory, model: ModelServer
) -> None:
    # Where eval-protocol's processors put reasoning_effort, and where servers take their own parameters.
    row = Row.new()
    asked = f"Say done ({row.rollout_id})."
    async with app_factory() as client:
        messages = [{"role": "user", "content": asked}]
        body = init_request(row, model="done", model_base_url=model.base_url(), messages=messages)
        body["completion_params"]["extra_body"] = {"reasoning_effort": "low", "top_k": 5}
        assert (await post_init(client, "/remote", body)).status_code == 200
        status = await wait_terminated(client, "/remote", row.rollout_id)
    assert status["state"] == "finished", status
    [sent] = [request.body for request in model.requests if request.user == asked]
    assert sent["reasoning_effort"] == "low" and sent["top_k"] == 5 and "extra_body" not in sent


async def test_an_init_offering_no_tools_offers_the_model_none(
    app_factory: AppFactory, model: ModelServer
) -> None:
    # `tools: []` is a row without tools; only an absent list (null) stands for every served tool.
    offered = {}
    for tools in ([], None):
        row = Row.new()
        asked = f"Say done ({row.rollout_id})."
        async with app_factory() as client:
            messages = [{"role": "user", "content": asked}]
            body = init_request(
                row, model="done", model_base_url=model.base_url(), messages=messages, tools=tools
            )
            assert (await post_init(client, "/remote", body)).status_code == 200
            assert (await wait_terminated(client, "/remote", row.rollout_id))["state"] == "finished"
        [sent] = [request for request in model.requests if request.user == asked]
        offered[str(tools)] = sent.tools
    assert offered["[]"] == [] and "increment" in offered["None"]


async def test_a_model_that_trickles_is_cut_at_the_deadline(
    app_factory: AppFactory, model: ModelServer
) -> None:
    row = Row.new()
    async with app_factory(remote_model_timeout_seconds=1.0) as client:
        body = init_request(row, model="trickle", model_base_url=model.base_url(), messages=USER)
        started = time.monotonic()
        assert (await post_init(client, "/remote", body)).status_code == 200
        status = await wait_terminated(client, "/remote", row.rollout_id, polls=300, interval=0.1)
    assert time.monotonic() - started < 15
    assert status["state"] == "error" and status["status"]["code"] == 14
    assert status["reason"] == "model_error: the model did not answer within 1 s"


@pytest.mark.parametrize("name", ["huge", "huge-gzip"])
async def test_a_model_answer_past_the_cap_fails_the_rollout(
    app_factory: AppFactory, model: ModelServer, name: str
) -> None:
    row = Row.new()
    async with app_factory(remote_model_max_bytes=64 * 1024) as client:
        body = init_request(row, model=name, model_base_url=model.base_url(), messages=USER)
        assert (await post_init(client, "/remote", body)).status_code == 200
        status = await wait_terminated(client, "/remote", row.rollout_id)
    assert status["state"] == "error" and status["status"]["code"] == 14
    assert status["reason"] == f"model_error: the model's answer is over {64 * 1024} bytes"


async def test_the_in_process_grader_takes_no_more_than_the_grade_route(
    app_factory: AppFactory, model: ModelServer, tmp_path: Path
) -> None:
    """A 1.2 MB answer passes the model cap, but its grade request is over the 1 MiB of /grade."""
    graders = write_graders(tmp_path, {"exact": GRADERS["exact"]})
    row = Row.new()
    async with app_factory(graders_file=graders, remote_grader="exact") as client:
        body = init_request(
            row, model="huge", model_base_url=model.base_url(), messages=USER, item={"reference_answer": "a"}
        )
        assert (await post_init(client, "/remote", body)).status_code == 200
        status = await wait_terminated(client, "/remote", row.rollout_id)
    assert status["state"] == "error" and status["reward"] is None
    assert status["reason"].startswith("grader_failed: the grade request is ")
    assert "over the 1048576-byte limit" in status["reason"]


async def test_a_row_without_the_field_its_grader_reads_is_a_configuration_error(
    app_factory: AppFactory, model: ModelServer, tmp_path: Path
) -> None:
    graders = write_graders(tmp_path, {"exact": GRADERS["exact"]})
    row = Row.new()
    async with app_factory(graders_file=graders, remote_grader="exact") as client:
        body = init_request(
            row, model="done", model_base_url=model.base_url(), messages=USER, item={"question": "q"}
        )
        assert (await post_init(client, "/remote", body)).status_code == 200
        status = await wait_terminated(client, "/remote", row.rollout_id)
    assert status["state"] == "error"
    assert status["status"]["code"] == 3  # INVALID_ARGUMENT: the row, not sparring (13) nor an outage
    assert status["reason"].startswith("grader_failed: grader 'exact' cannot grade this item")
    assert "reference_answer" in status["reason"]


# The embedded backend only: Postgres keeps the stored sample's number as a JSONB numeric, which reads
# back as an integer past 64 bits that the review export (of every rollout of the database) cannot write.
@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
@pytest.mark.parametrize("digits", [30, 400])
async def test_an_answer_holding_an_integer_past_64_bits_is_graded(
    app_factory: AppFactory, model: ModelServer, tmp_path: Path, digits: int
) -> None:
    # JSON has no bound on integers, and the answer's `output_json` keeps Python's; the grade route
    # reads such a number as a float, so the in-process grade takes it too.
    answer = f'{{"total": {"9" * digits}}}'
    model.scripts["big"] = [Turn(text=answer)]
    graders = write_graders(tmp_path, {"exact": GRADERS["exact"]})
    row = Row.new()
    async with app_factory(graders_file=graders, remote_grader="exact") as client:
        body = init_request(
            row,
            model="big",
            model_base_url=model.base_url(),
            messages=USER,
            item={"reference_answer": answer},
        )
        assert (await post_init(client, "/remote", body)).status_code == 200
        status = await wait_terminated(client, "/remote", row.rollout_id)
    assert status["state"] == "finished", status
    assert status["reward"] == 1.0


async def test_a_row_whose_user_scenario_is_unusable_is_a_configuration_error(
    app_factory: AppFactory, model: ModelServer
) -> None:
    row = Row.new()
    async with app_factory(user_model="done", user_base_url=model.base_url()) as client:
        item = {"id": "r1", "user_simulator": {"scenario": "not an object"}}
        body = init_request(row, model="done", model_base_url=model.base_url(), messages=USER, item=item)
        assert (await post_init(client, "/remote", body)).status_code == 200
        status = await wait_terminated(client, "/remote", row.rollout_id)
    assert status["state"] == "error" and status["reason"].startswith("user_error: ")
    assert status["status"]["code"] == 3  # INVALID_ARGUMENT: every retry of the row meets the same error


async def test_the_http_client_of_remote_rollouts_is_bounded_too(model: ModelServer) -> None:
    http = build_model_http(Settings(remote_allowed_hosts=["127.0.0.1"], remote_model_max_bytes=4096))
    try:
        with pytest.raises(httpx2.TransportError, match="over 4096 bytes"):
            await http.post(f"{model.base_url()}/chat/completions", json={"model": "huge"})
        # The status log goes through the same client, so the same rule.
        with pytest.raises(RefusedDestination):
            await http.post(f"http://127.0.0.2:{model.port}/logs", json={})
    finally:
        await http.aclose()


async def test_a_gateway_that_trickles_its_answer_does_not_hold_the_rollout(model: ModelServer) -> None:
    """The status log is posted through the model client, whose read timeout bounds only the gap
    between bytes: a gateway answering one byte every 0.2 s held /init (and the rollout's slot) for as
    long as it trickled."""
    http = build_model_http(Settings(remote_allowed_hosts=["127.0.0.1"]))
    body = init_request(Row.new(), model="done", model_base_url=model.base_url(), messages=USER)
    rollout = plan(InitRequest.model_validate({**body, "status_log_url": model.base_url("trickle/logs")}))
    report = GatewayStatusLog(http, attempts=1, delay_s=0)
    try:
        # A guard against the hang (the trickle lasts two minutes), not a measure of the wait.
        await asyncio.wait_for(report(rollout, {"status": status_of("running", CODE_RUNNING, None)}), 60)
    finally:
        await http.aclose()
