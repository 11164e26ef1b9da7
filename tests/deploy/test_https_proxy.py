"""HTTPS end to end: nginx (TLS, round-robin) in front of two sparring processes sharing Postgres and Redis.

The nginx configuration is deploy/nginx/sparring.conf.template, rendered with a self-signed certificate
and the two processes as upstreams; the processes are started with `sparring serve`, as the container's
entrypoint starts them. Needs the Debian package `nginx` (skipped with a reason if it is absent).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from app.db.migrate import upgrade
from tests.conftest import (
    ADMIN_KEY,
    API_KEYS,
    REDIS_KEY_PREFIX,
    REDIS_URL,
    RUN_ID,
    TOOLS_KEY,
    create_pg_database,
    drop_pg_database,
)
from tests.deploy.procs import REPO, Processes, clean_env, free_port, processes, wait_http, wait_tcp

TEMPLATE = REPO / "deploy" / "nginx" / "sparring.conf.template"
WORKERS = ("a", "b")
CLIENT_ADDRESS = "127.0.0.2"  # the test's own loopback source address, distinct from nginx's 127.0.0.1


def find_nginx() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


NGINX = find_nginx()
pytestmark = pytest.mark.skipif(
    NGINX is None, reason="nginx is not installed (CI installs it: apt-get install -y nginx openssl)"
)


def render_template(**values: str) -> str:
    """envsubst restricted to the given names, as docs/deploy.md renders it; nginx's $vars stay."""
    text = TEMPLATE.read_text()
    for name, value in values.items():
        text = text.replace("${" + name + "}", value)
    left = re.findall(r"\$\{\w+\}", text)
    assert not left, f"unrendered template variables: {left}"
    return text


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed (CI installs it: apt-get install -y nginx openssl)")
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return cert, key


def nginx_main_config(directory: Path, site: Path) -> Path:
    """A minimal main configuration around the site template: everything under the test's directory."""
    user = "user root;" if os.geteuid() == 0 else ""  # workers must reach the test's private tmp dir
    temp = "\n".join(
        f"    {kind}_temp_path {directory / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    config = directory / "nginx.conf"
    config.write_text(
        f"""{user}
worker_processes 1;
pid {directory / "nginx.pid"};
error_log {directory / "nginx-error.log"} info;
events {{ worker_connections 256; }}
http {{
    access_log {directory / "nginx-access.log"};
{temp}
    include {site};
}}
"""
    )
    return config


@dataclass
class Stack:
    https: str
    http_redirect_port: int
    https_port: int
    apps: dict[str, str]  # worker name -> direct http URL
    app_logs: dict[str, Path]
    tls: ssl.SSLContext
    traces: list[str]

    def client(self, key: str = TOOLS_KEY, **kwargs: Any) -> httpx.Client:
        return httpx.Client(
            base_url=self.https, verify=self.tls, headers={"Authorization": f"Bearer {key}"}, timeout=15,
            **kwargs,
        )  # fmt: skip

    def new_trace(self) -> str:
        trace = f"trace_{uuid.uuid4().hex}"
        self.traces.append(trace)
        return trace


@pytest.fixture(scope="module")
async def deploy_database() -> AsyncIterator[str]:
    name = f"sparring_deploy_{RUN_ID}"
    url = await create_pg_database(name)
    await asyncio.to_thread(upgrade, url)
    yield url
    await drop_pg_database(name)


@pytest.fixture(scope="module")
def stack(deploy_database: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    assert NGINX is not None
    root = tmp_path_factory.mktemp("https-stack")
    cert, key = self_signed_certificate(root)
    https_port, http_port = free_port(), free_port()
    ports = {name: free_port() for name in WORKERS}

    with processes(root) as procs:
        apps = start_apps(procs, root, deploy_database, ports)
        site = root / "sparring.conf"
        site.write_text(
            render_template(
                UPSTREAM_SERVERS=" ".join(f"server 127.0.0.1:{port};" for port in ports.values()),
                HTTPS_LISTEN=f"127.0.0.1:{https_port}",
                HTTP_LISTEN=f"127.0.0.1:{http_port}",
                SERVER_NAME="localhost 127.0.0.1",
                TLS_CERTIFICATE=str(cert),
                TLS_CERTIFICATE_KEY=str(key),
            )
        )
        config = nginx_main_config(root, site)
        nginx = procs.start(
            "nginx",
            [
                NGINX,
                "-p",
                str(root),
                "-c",
                str(config),
                "-e",
                str(root / "nginx-error.log"),
                "-g",
                "daemon off;",
            ],
            env=clean_env(),
        )
        wait_tcp(https_port, nginx)
        wait_tcp(http_port, nginx)
        tls = ssl.create_default_context(cafile=str(cert))
        stack = Stack(
            https=f"https://127.0.0.1:{https_port}",
            http_redirect_port=http_port,
            https_port=https_port,
            apps={name: f"http://127.0.0.1:{port}" for name, port in ports.items()},
            app_logs=apps,
            tls=tls,
            traces=[],
        )
        try:
            yield stack
        finally:
            forget_traces(stack.traces)


def start_apps(procs: Processes, root: Path, database_url: str, ports: dict[str, int]) -> dict[str, Path]:
    started = {}
    for name, port in ports.items():
        env = clean_env(
            SPARRING_DATABASE_URL=database_url,
            SPARRING_REDIS_URL=REDIS_URL,
            SPARRING_REDIS_KEY_PREFIX=REDIS_KEY_PREFIX,
            SPARRING_API_KEYS=API_KEYS,
            SPARRING_WORKER_NAME=name,
            SPARRING_FORWARDED_ALLOW_IPS="127.0.0.1",
            SPARRING_HOME=str(root / f"home-{name}"),
            SPARRING_PACKS="demo",
            SPARRING_STATE_TTL_SECONDS="600",
            SPARRING_ACCESS_LOG="true",  # the client-address test reads its lines
        )
        cmd = [
            sys.executable,
            "-m",
            "app.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        started[name] = procs.start(f"app-{name}", cmd, env=env)
    for name, proc in started.items():
        wait_http(f"http://127.0.0.1:{ports[name]}/healthz", proc)
    return {name: proc.log for name, proc in started.items()}


def forget_traces(traces: list[str]) -> None:
    """Remove the test's rollout keys from the shared Redis database (they would expire anyway)."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for trace in traces:
            keys = list(client.scan_iter(match=f"{REDIS_KEY_PREFIX}:{{{trace}}}*", count=1000))
            if keys:
                client.delete(*keys)
    finally:
        client.close()


def tool_call(client: httpx.Client, tool: str, trace: str, call_id: str, **arguments: Any) -> str:
    body = {
        "type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": tool,
        "arguments": json.dumps(arguments), "trace_id": trace, "item": {},
    }  # fmt: skip
    response = client.post(f"/tools/{tool}", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["type"] == "function_call_output" and answer["call_id"] == call_id
    return str(answer["output"])


def test_a_rollout_alternates_between_replicas_and_sees_one_state(stack: Stack) -> None:
    trace = stack.new_trace()
    with stack.client() as client:
        outputs = [
            tool_call(client, "add_note", trace, f"call_{i}", title=f"note {i}", body=f"body {i}")
            for i in range(3)
        ]
        listed = json.loads(tool_call(client, "list_notes", trace, "call_list"))
        assert client.get("/readyz").json() == {"status": "ready"}

    # Each note saw the ones before it, whichever process wrote them: one rollout state.
    assert [json.loads(o)["number"] for o in outputs] == [1, 2, 3]
    assert [(n["number"], n["title"]) for n in listed] == [(1, "note 0"), (2, "note 1"), (3, "note 2")]

    with stack.client(ADMIN_KEY) as admin:
        detail = admin.get(f"/rollouts/{trace}").json()
    workers = [call["worker"] for call in detail["timeline"]]
    assert [call["tool"] for call in detail["timeline"]] == ["add_note"] * 3 + ["list_notes"]
    assert set(workers) == set(WORKERS), workers
    assert all(x != y for x, y in itertools.pairwise(workers)), f"not round-robin: {workers}"


def test_a_retried_call_is_answered_once_by_either_replica(stack: Stack) -> None:
    trace = stack.new_trace()
    with stack.client() as client:
        first = tool_call(client, "add_note", trace, "call_1", title="only", body="once")
        # Two retries of the same call: round-robin sends one of them to each process.
        retries = [
            tool_call(client, "add_note", trace, "call_1", title="only", body="once") for _ in range(2)
        ]
        notes = json.loads(tool_call(client, "list_notes", trace, "call_list"))
    assert retries == [first, first]
    assert [n["title"] for n in notes] == ["only"]


def test_plain_http_is_refused_on_the_https_port_and_redirected_on_the_http_port(stack: Stack) -> None:
    refused = httpx.get(f"http://127.0.0.1:{stack.https_port}/healthz", timeout=5)
    assert refused.status_code == 400
    assert "The plain HTTP request was sent to HTTPS port" in refused.text

    redirected = httpx.post(
        f"http://127.0.0.1:{stack.http_redirect_port}/tools/echo?x=1",
        headers={"Host": "127.0.0.1"},
        json={"arguments": {"text": "hi"}},
        timeout=5,
    )
    assert redirected.status_code == 308
    assert redirected.headers["location"] == "https://127.0.0.1/tools/echo?x=1"


def access_line(logs: list[Path], marker: str, timeout: float = 5.0) -> str:
    """The access-log line (in any of the processes' logs) of the request carrying `marker`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for log in logs:
            for line in log.read_text(errors="replace").splitlines():
                if marker in line:
                    return line
        time.sleep(0.05)
    raise AssertionError(f"no access-log line with {marker} in {[log.name for log in logs]}")


def test_the_app_logs_the_real_client_address(stack: Stack) -> None:
    """nginx sets X-Forwarded-For to the client it saw; the app trusts it only from 127.0.0.1."""
    spoofed = {"X-Forwarded-For": "203.0.113.9"}
    logs = list(stack.app_logs.values())
    transport = httpx.HTTPTransport(local_address=CLIENT_ADDRESS, verify=stack.tls)
    with httpx.Client(base_url=stack.https, transport=transport, timeout=10) as client:
        for _ in WORKERS:  # round-robin: one request lands on each process
            marker = uuid.uuid4().hex
            assert client.get(f"/healthz?probe={marker}", headers=spoofed).status_code == 200
            line = access_line(logs, marker)
            assert f"{CLIENT_ADDRESS}:" in line, line  # the client nginx saw, not nginx's 127.0.0.1
            assert "203.0.113.9" not in line, line  # a header the client sent itself is not believed

    # Straight to a process from an address that is not a trusted proxy: the header is ignored.
    marker = uuid.uuid4().hex
    direct = httpx.HTTPTransport(local_address=CLIENT_ADDRESS)
    with httpx.Client(base_url=stack.apps["a"], transport=direct, timeout=10) as client:
        assert client.get(f"/healthz?probe={marker}", headers=spoofed).status_code == 200
    line = access_line([stack.app_logs["a"]], marker)
    assert f"{CLIENT_ADDRESS}:" in line and "203.0.113.9" not in line, line
