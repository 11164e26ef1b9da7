"""`docker compose up` as users run it: the whole stack of docker-compose.yml (Postgres, Redis, two app
replicas, Caddy with HTTPS) under a real Compose, with the image the Dockerfile builds.

Where the public images cannot be pulled (here: no registry), tests/deploy/compose-standins.yml
replaces postgres, redis and caddy by one stand-in image built from Debian's packages on the Debian base
of test_docker_image.py (tests/deploy/standins); the compose file, the Caddyfile, the app image and
.env.example are the shipped ones. Compose is `docker compose` (v2) where the plugin runs, else
Debian's `docker-compose` (v1). Images and build layers stay cached between runs.

Checked over HTTPS through Caddy (its internal CA's root trusted): a tool call and a grade; a replica
killed in the middle of a load, with every call answered (the client retries as the contract says:
the same call_id after a 502/503) and each logged once; and a `down` + `up` that keeps the call log.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import ssl
import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import ADMIN_KEY, API_KEYS, GRADER_KEY, TOOLS_KEY
from tests.deploy.procs import REPO, free_port
from tests.deploy.test_container_files import compose_command
from tests.deploy.test_docker_image import (  # noqa: F401  (module fixtures: the engine, base and image)
    base_image,
    digest,
    docker,
    image,
    image_exists,
    run,
    unavailable,
    wheelhouse,
)

STANDINS = Path(__file__).with_name("standins")
OVERRIDE = Path(__file__).with_name("compose-standins.yml")
GRADERS_YAML = """\
exact:
  type: string_check
  name: exact
  operation: eq
  input: "{{ sample.output_text }}"
  reference: "{{ item.reference_answer }}"
"""
LOAD_CALLS = 60


@pytest.fixture(scope="module")
def standin_image(docker: str, base_image: str) -> str:  # noqa: F811
    """postgres, redis-server and caddy from Debian's packages on the test base (cached by content)."""
    files = sorted((p.name, p.read_text()) for p in STANDINS.iterdir())
    tag = f"sparring-test-standin:{digest(base_image, files)}"
    if not image_exists(docker, tag):
        run([docker, "build", "--build-arg", f"BASE={base_image}", "--tag", tag, str(STANDINS)], timeout=900)
    return tag


@dataclass
class Stack:
    command: list[str]
    directory: Path
    project: str
    https_port: int

    @property
    def url(self) -> str:
        return f"https://localhost:{self.https_port}"

    def compose(self, *args: str, timeout: float = 300) -> str:
        return run(
            [*self.command, "--project-directory", str(self.directory), "--project-name", self.project,
             "-f", str(self.directory / "docker-compose.yml"), "-f", str(self.directory / "standins.yml"),
             *args],
            timeout=timeout,
        )  # fmt: skip

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).split()


def env_file(directory: Path, app_image: str, standin: str, https_port: int) -> None:
    """.env.example with the required values filled in, as a user does, and the test's ports and images."""
    env = (REPO / ".env.example").read_text()
    env = re.sub(r"^SPARRING_API_KEYS=$", f"SPARRING_API_KEYS={API_KEYS}", env, flags=re.M)
    env = re.sub(r"^POSTGRES_PASSWORD=$", f"POSTGRES_PASSWORD={uuid.uuid4().hex}", env, flags=re.M)
    env += (
        f"\nHTTP_PORT={free_port()}\nHTTPS_PORT={https_port}\n"
        f"SPARRING_PUBLIC_BASE_URL=https://localhost:{https_port}\n"
        f"EDGE_SUBNET=172.30.{random.randrange(100, 250)}.0/24\nSPARRING_WORKERS=1\n"
        f"APP_IMAGE={app_image}\nSTANDIN_IMAGE={standin}\n"
    )
    (directory / ".env").write_text(env)


@pytest.fixture(scope="module")
def stack(image: str, standin_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:  # noqa: F811
    command = compose_command()
    if command is None:
        unavailable("neither `docker compose` nor `docker-compose` is installed (Debian: docker-compose)")
    assert command is not None
    directory = tmp_path_factory.mktemp("compose")
    shutil.copy(REPO / "docker-compose.yml", directory / "docker-compose.yml")
    shutil.copytree(REPO / "deploy", directory / "deploy", ignore=shutil.ignore_patterns("wheelhouse"))
    shutil.copy(OVERRIDE, directory / "standins.yml")
    (directory / "graders.yaml").write_text(GRADERS_YAML)
    https_port = free_port()
    env_file(directory, image, standin_image, https_port)
    made = Stack(command, directory, f"sparringtest{os.getpid()}", https_port)
    try:
        try:
            made.compose("up", "-d", "--no-build", timeout=600)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{made.compose('logs', '--tail', '40')[-6000:]}") from None
        yield made
    finally:
        subprocess.run(
            [*command, "--project-directory", str(directory), "--project-name", made.project,
             "-f", str(directory / "docker-compose.yml"), "-f", str(directory / "standins.yml"),
             "down", "--volumes", "--remove-orphans", "--timeout", "10"],
            capture_output=True, timeout=300,
        )  # fmt: skip


def trusted_client(stack: Stack, docker: str) -> httpx.Client:  # noqa: F811
    """An HTTPS client trusting Caddy's internal CA (its root, copied out of the caddy container)."""
    deadline = time.monotonic() + 120
    root = stack.directory / "caddy-root.crt"
    while True:
        [caddy] = stack.containers("caddy")
        copied = subprocess.run(
            [docker, "cp", f"{caddy}:/data/caddy/pki/authorities/local/root.crt", str(root)],
            capture_output=True, timeout=60,
        )  # fmt: skip
        if copied.returncode == 0:
            break
        assert time.monotonic() < deadline, copied.stderr
        time.sleep(1)
    return httpx.Client(base_url=stack.url, verify=ssl.create_default_context(cafile=str(root)), timeout=30)


def wait_ready(client: httpx.Client, limit: float = 300) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            if client.get("/readyz").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("the stack did not become ready through Caddy")


def call(client: httpx.Client, tool: str, trace: str, call_id: str, arguments: dict[str, str]) -> str:
    """A tool call as a trainer makes it: the same call_id again after a 502/503 or a dropped connection."""
    body = {
        "type": "function_call",
        "trace_id": trace,
        "call_id": call_id,
        "arguments": json.dumps(arguments),
    }
    headers = {"Authorization": f"Bearer {TOOLS_KEY}"}
    deadline = time.monotonic() + 90
    while True:
        try:
            answer = client.post(f"/tools/{tool}", json=body, headers=headers)
            if answer.status_code == 200:
                output: str = answer.json()["output"]
                return output
            assert answer.status_code in (502, 503, 504), answer.text
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{call_id} got no answer"
        time.sleep(0.5)


def rollout(client: httpx.Client, trace: str) -> dict[str, object]:
    answer = client.get(f"/rollouts/{trace}", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert answer.status_code == 200, answer.text
    found: dict[str, object] = answer.json()
    return found


def test_the_stack_serves_grades_survives_a_replica_and_keeps_its_log(stack: Stack, docker: str) -> None:  # noqa: F811
    with trusted_client(stack, docker) as client:
        wait_ready(client)
        assert len(stack.containers("app")) == 2

        # A tool call and a grade, over HTTPS through Caddy.
        first = f"trace_{uuid.uuid4().hex}"
        assert call(client, "echo", first, "c1", {"text": "42"}) == "42"
        grade = client.post(
            "/grade/exact",
            json={"trace_id": first, "sample": {"output_text": "42"}, "item": {"reference_answer": "42"}},
            headers={"Authorization": f"Bearer {GRADER_KEY}"},
        )
        assert grade.status_code == 200 and grade.json() == {"score": 1.0}, grade.text

        # A replica killed while calls are in flight: every call is answered, each note added once.
        load = f"trace_{uuid.uuid4().hex}"
        victim = stack.containers("app")[0]
        with ThreadPoolExecutor(8) as pool:
            futures = [
                pool.submit(call, client, "add_note", load, f"n{i}", {"title": f"t{i}", "body": "b"})
                for i in range(LOAD_CALLS)
            ]
            while sum(f.done() for f in futures) < LOAD_CALLS // 4:
                time.sleep(0.05)
            run([docker, "kill", victim], timeout=60)
            outputs = [f.result() for f in futures]
        numbers = sorted(json.loads(output)["number"] for output in outputs)
        assert numbers == list(range(1, LOAD_CALLS + 1)), "a call ran twice or not at all"
        assert rollout(client, load)["call_count"] == LOAD_CALLS

    # Down and up again (volumes kept): the call log is still there.
    stack.compose("down", "--timeout", "20")
    stack.compose("up", "-d", "--no-build", timeout=600)
    with trusted_client(stack, docker) as client:
        wait_ready(client)
        kept = rollout(client, first)
        assert kept["call_count"] == 1
        assert rollout(client, load)["call_count"] == LOAD_CALLS
