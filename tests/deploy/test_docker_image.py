"""The image, built by a real Docker engine without network and run against this machine's Postgres and Redis.

Nothing here reaches an image registry: the base image is made from Debian packages on the host
(`mmdebstrap` of bookworm with python3 and python3-venv, then `docker import`), the dependencies come
from a wheelhouse that the host's Debian Python builds, and the Dockerfile builds with `OFFLINE=1` and
`--network none`. The base image and the wheelhouse are cached between runs (outside the repository,
under SPARRING_TEST_CACHE, default /var/cache/sparring-test), so only the first run is slow.

The container runs with the host's network (the simplest way to reach the Postgres and Redis that
listen on 127.0.0.1) and binds 127.0.0.1 (SPARRING_HOST), on a free port.

Needs Debian's `docker.io` with `dockerd` running and `mmdebstrap`; `.ci/run` installs and starts them.
Without a Docker engine the test is skipped, except under CI (CI=true), where it fails instead.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
import tomllib
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from app.db.migrate import head_revision
from tests.conftest import (
    ADMIN_KEY,
    API_KEYS,
    GRADER_KEY,
    REDIS_KEY_PREFIX,
    REDIS_URL,
    TOOLS_KEY,
    create_pg_database,
    drop_pg_database,
)
from tests.deploy.procs import REPO, free_port

CACHE = Path(os.environ.get("SPARRING_TEST_CACHE", "/var/cache/sparring-test"))
SUITE = "bookworm"
# What the Dockerfile needs from its base: `python` (3.11+) with venv and pip, a shell, groupadd/useradd.
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3")
# The interpreter that builds the wheelhouse: Debian's, so the wheels match the base image's Python.
HOST_PYTHON = Path("/usr/bin/python3")
PG_ADMIN_URL = os.environ.get("SPARRING_TEST_PG", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres")
# Docker's build cache left after the test (the cached dependency layers fit well within it).
CACHE_KEEP_BYTES = 3 * 2**30
# The stop grace period given to the container, as a Kubernetes pod or `docker stop -t` would.
GRACE_SECONDS = 30
GRADERS_YAML = """\
answer_after_note:
  type: multi
  name: answer_after_note
  graders:
    correct: {type: string_check, name: correct, operation: eq,
              input: "{{ sample.output_text }}", reference: "{{ item.reference_answer }}"}
    noted: {type: required_tools, name: noted, tools: [add_note]}
  calculate_output: "correct * noted"
"""
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(reason: str) -> None:
    """Skip where no Docker engine can run; under CI a missing engine is a failure."""
    if IN_CI:
        pytest.fail(f"{reason} (CI must build and run the image: see .ci/run)")
    pytest.skip(reason)


def docker_client() -> str | None:
    # Debian's client first: it drives Debian's engine with its built-in BuildKit, where a
    # standalone newer client would want the buildx plugin for the same build.
    debian = Path("/usr/bin/docker")
    return str(debian) if debian.exists() else shutil.which("docker")


def run(args: list[str], *, timeout: float, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL
    )
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(args[:3])} ... exited {result.returncode}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result.stdout


@contextmanager
def cache_lock() -> Iterator[None]:
    """One maker of the cached base image and wheelhouse at a time on this machine."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def docker() -> str:
    client = docker_client()
    if client is None:
        unavailable("no docker client (Debian package docker.io)")
    assert client is not None
    try:
        probe = subprocess.run(
            [client, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        unavailable("the Docker engine does not answer `docker info` within 30 s")
    if probe.returncode != 0:
        unavailable(f"no Docker engine running (start dockerd): {probe.stderr.strip()[:300]}")
    return client


def image_exists(docker: str, tag: str) -> bool:
    probe = subprocess.run([docker, "image", "inspect", tag], capture_output=True, timeout=60)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def base_image(docker: str) -> str:
    """Debian bookworm with python3 and python3-venv, made from Debian packages and imported once."""
    key = digest(SUITE, "minbase", BASE_PACKAGES, 1)
    tag = f"sparring-test-base:{key}"
    with cache_lock():
        if image_exists(docker, tag):
            return tag
        mmdebstrap = shutil.which("mmdebstrap")
        if mmdebstrap is None:
            unavailable("mmdebstrap is not installed (Debian package mmdebstrap) to make the base image")
        assert mmdebstrap is not None
        tarball = CACHE / f"base-{key}.tar"
        run(
            [mmdebstrap, "--quiet", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
             "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
             "--dpkgopt=path-exclude=/usr/share/locale/*", SUITE, str(tarball)],
            timeout=900,
        )  # fmt: skip
        try:
            run(
                [docker, "import",
                 "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 "--change", "ENV LANG=C.UTF-8", str(tarball), tag],
                timeout=300,
            )  # fmt: skip
        finally:
            tarball.unlink(missing_ok=True)
    return tag


def python_version(docker: str, image: str) -> str:
    return run(
        [docker, "run", "--rm", "--network", "none", image, "python", "-c",
         "import platform; print(platform.python_version())"],
        timeout=120,
    ).strip()  # fmt: skip


@pytest.fixture(scope="module")
def wheelhouse(docker: str, base_image: str) -> Path:
    """Wheels of every pinned dependency and of the build backend, made by the host's Debian Python."""
    if not HOST_PYTHON.exists():
        unavailable(f"{HOST_PYTHON} (Debian's python3, with python3-venv) builds the wheelhouse")
    host_version = run(
        [str(HOST_PYTHON), "-c", "import platform; print(platform.python_version())"], timeout=30
    )
    image_version = python_version(docker, base_image)
    # Environment markers (e.g. python_full_version < "3.11.3") choose dependencies: the wheels must be
    # resolved by the same Python as the image's.
    assert host_version.strip() == image_version, (
        f"host {HOST_PYTHON} is {host_version.strip()} but the base image has {image_version}: "
        "`apt-get install python3` on the host, or remove the cached base image"
    )
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    project = pyproject["project"]
    requirements = [
        *project["dependencies"],
        *project["optional-dependencies"]["server"],
        *pyproject["build-system"]["requires"],
    ]
    path = CACHE / f"wheelhouse-{digest(requirements, image_version)}"
    with cache_lock():
        if (path / ".complete").exists():
            return path
        venv = CACHE / f"wheel-builder-{image_version}"
        if not (venv / "bin" / "pip").exists():
            run([str(HOST_PYTHON), "-m", "venv", "--clear", str(venv)], timeout=120)
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        run(
            [str(venv / "bin" / "pip"), "wheel", "--quiet", "--disable-pip-version-check",
             "--wheel-dir", str(partial), *requirements],
            timeout=900,
        )  # fmt: skip
        (partial / ".complete").write_text("\n".join(requirements) + "\n")
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)
    return path


def build_context(context: Path, wheelhouse: Path) -> Path:
    """The image's build context: the sources the Dockerfile copies, and the wheels in deploy/wheelhouse."""
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, context / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.whl")
    for name in ("app", "tools", "migrations", "sparring", "deploy"):
        shutil.copytree(REPO / name, context / name, ignore=skip)
    for wheel in wheelhouse.glob("*.whl"):
        shutil.copy2(wheel, context / "deploy" / "wheelhouse" / wheel.name)
    return context


@pytest.fixture(scope="module")
def image(
    docker: str, base_image: str, wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The Dockerfile as committed, built offline: `OFFLINE=1`, the wheelhouse in the context, no network."""
    context = build_context(tmp_path_factory.mktemp("context"), wheelhouse)
    tag = f"sparring-test:{os.getpid()}-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    run(
        [docker, "build", "--network", "none", "--build-arg", "OFFLINE=1",
         "--build-arg", f"PYTHON_IMAGE={base_image}", "--tag", tag, str(context)],
        timeout=1200, env=env,
    )  # fmt: skip
    yield tag
    subprocess.run([docker, "rmi", "--force", tag], capture_output=True, timeout=120)
    # Every change of the sources leaves a few cached layers behind: keep the build cache bounded.
    subprocess.run(
        [docker, "builder", "prune", "--force", "--keep-storage", str(CACHE_KEEP_BYTES)],
        capture_output=True, timeout=300, env=env,
    )  # fmt: skip


@pytest.fixture
async def database() -> AsyncIterator[str]:
    """An empty Postgres database: the container's entrypoint migrates it."""
    name = f"sparring_docker_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = await create_pg_database(name)
    yield url
    await drop_pg_database(name)


class Container:
    def __init__(self, docker: str, name: str) -> None:
        self.docker = docker
        self.name = name

    def inspect(self, template: str) -> str:
        return run([self.docker, "inspect", "--format", template, self.name], timeout=60).strip()

    def logs(self) -> str:
        result = subprocess.run([self.docker, "logs", self.name], capture_output=True, text=True, timeout=60)
        return (result.stdout + result.stderr)[-6000:]

    def exec(self, *args: str) -> str:
        return run([self.docker, "exec", self.name, *args], timeout=60)


@pytest.fixture
def container(docker: str, image: str, database: str, tmp_path: Path) -> Iterator[tuple[Container, int]]:
    graders = tmp_path / "graders.yaml"
    graders.write_text(GRADERS_YAML)
    graders.chmod(0o644)
    port = free_port()
    name = f"sparring-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    run(
        [docker, "run", "--detach", "--name", name, "--network", "host",
         "--env", f"SPARRING_DATABASE_URL={database}",
         "--env", f"SPARRING_REDIS_URL={REDIS_URL}",
         "--env", f"SPARRING_REDIS_KEY_PREFIX={REDIS_KEY_PREFIX}",
         "--env", f"SPARRING_API_KEYS={API_KEYS}",
         "--env", "SPARRING_HOST=127.0.0.1",
         "--env", f"SPARRING_PORT={port}",
         "--env", "SPARRING_WORKERS=2",
         "--env", "SPARRING_GRADERS_FILE=/etc/sparring/graders.yaml",
         "--volume", f"{graders}:/etc/sparring/graders.yaml:ro",
         "--stop-timeout", str(GRACE_SECONDS),
         image],
        timeout=120,
    )  # fmt: skip
    try:
        yield Container(docker, name), port
    finally:
        subprocess.run([docker, "rm", "--force", name], capture_output=True, timeout=120)


def wait_healthy(container: Container, timeout: float = 180.0) -> None:
    """Docker's own HEALTHCHECK (the Dockerfile's) must report healthy; bounded."""
    deadline = time.monotonic() + timeout
    status = ""
    while time.monotonic() < deadline:
        status = container.inspect("{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}")
        if status == "running healthy":
            return
        if not status.startswith("running"):
            break
        time.sleep(1)
    raise AssertionError(f"container not healthy ({status}); its logs:\n{container.logs()}")


def process_uids(pid: int) -> set[str]:
    """Real and effective uids of a host process and of every process below it."""
    uids: set[str] = set()
    pending = [pid]
    while pending:
        current = pending.pop()
        status = Path(f"/proc/{current}/status").read_text()
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        uids.update(uid_line.split()[1:3])
        children = Path(f"/proc/{current}/task/{current}/children")
        if children.exists():
            pending.extend(int(child) for child in children.read_text().split())
    return uids


async def test_the_offline_built_image_migrates_serves_grades_and_stops_cleanly(
    container: tuple[Container, int], database: str
) -> None:
    box, port = container
    await asyncio.to_thread(wait_healthy, box)
    base = f"http://127.0.0.1:{port}"

    # The entrypoint migrated the empty database to the image's head.
    engine = create_async_engine(database)
    try:
        async with engine.connect() as conn:
            version = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar_one()
        assert version == head_revision()

        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            ready = await client.get("/readyz")
            assert ready.status_code == 200, ready.text

            trace = f"trace_{uuid.uuid4().hex}"
            tools = {"Authorization": f"Bearer {TOOLS_KEY}"}
            body = {"type": "function_call", "trace_id": trace, "call_id": "c1",
                    "arguments": json.dumps({"title": "answer", "body": "42"})}  # fmt: skip
            added = await client.post("/tools/add_note", json=body, headers=tools)
            assert added.status_code == 200, added.text
            assert json.loads(added.json()["output"]) == {"number": 1, "title": "answer", "body": "42"}
            # A retry of the same call is answered from the ledger, not run again.
            again = await client.post("/tools/add_note", json=body, headers=tools)
            assert again.json() == added.json()
            listed = await client.post(
                "/tools/list_notes",
                json={"type": "function_call", "trace_id": trace, "call_id": "c2", "arguments": "{}"},
                headers=tools,
            )
            assert json.loads(listed.json()["output"]) == [{"number": 1, "title": "answer", "body": "42"}]
            denied = await client.post("/tools/list_notes", json=body, headers={"Authorization": "Bearer x"})
            assert denied.status_code == 401

            grader = {"Authorization": f"Bearer {GRADER_KEY}"}
            grade_body = {"sample": {"output_text": "42"}, "item": {"reference_answer": "42"}}
            graded = await client.post(
                "/grade/answer_after_note", json={**grade_body, "trace_id": trace}, headers=grader
            )
            assert graded.status_code == 200, graded.text
            assert graded.json() == {"score": 1.0}
            # The same answer without the note-taking rollout scores 0: the grader read the call log.
            unnoted = await client.post(
                "/grade/answer_after_note",
                json={**grade_body, "trace_id": f"trace_{uuid.uuid4().hex}"},
                headers=grader,
            )
            assert unnoted.json() == {"score": 0.0}
            assert (
                await client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            ).status_code == 200

        # The calls are in the durable log: the tool ran once, and the retry is logged as a replay of
        # it (one row per attempt), not as a second run. The grade is stored.
        async with engine.connect() as conn:
            logged = (
                await conn.execute(
                    text("SELECT tool, outcome FROM tool_calls WHERE trace_id = :t ORDER BY id"), {"t": trace}
                )
            ).all()
            grades = (
                await conn.execute(text("SELECT score FROM grades WHERE trace_id = :t"), {"t": trace})
            ).scalars().all()  # fmt: skip
        assert [tuple(row) for row in logged] == [
            ("add_note", "ok"),
            ("add_note", "replayed"),
            ("list_notes", "ok"),
        ]
        assert grades == [1.0]
    finally:
        await engine.dispose()

    # Every process of the container runs as the image's unprivileged user.
    assert box.exec("id", "-u").strip() == "10001"
    pid = int(box.inspect("{{.State.Pid}}"))
    assert process_uids(pid) == {"10001"}, process_uids(pid)

    # SIGTERM (what `docker stop` and Kubernetes send): the server shuts down by itself well within the
    # grace period and exits 0, instead of being killed (137) when the period runs out.
    run([box.docker, "kill", "--signal", "TERM", box.name], timeout=60)
    waited = await asyncio.to_thread(
        subprocess.run, [box.docker, "wait", box.name], capture_output=True, text=True, timeout=GRACE_SECONDS
    )
    assert waited.stdout.strip() == "0", f"exit status {waited.stdout!r}; logs:\n{box.logs()}"
    logs = box.logs()
    assert "Finished server process" in logs, logs
    assert box.inspect("{{.State.OOMKilled}}") == "false"


def test_a_code_pack_build_on_a_base_without_bubblewrap_fails(
    docker: str, base_image: str, wheelhouse: Path, image: str, tmp_path: Path
) -> None:
    """The test base has no bubblewrap and an offline build cannot install it: with CODE_PACK=1 the build
    stops there (the build stage is the cached one of `image`), instead of shipping a broken code pack."""
    context = build_context(tmp_path, wheelhouse)
    build = subprocess.run(
        [docker, "build", "--network", "none", "--build-arg", "OFFLINE=1", "--build-arg", "CODE_PACK=1",
         "--build-arg", f"PYTHON_IMAGE={base_image}", str(context)],
        capture_output=True, text=True, timeout=1200, env={**os.environ, "DOCKER_BUILDKIT": "1"},
    )  # fmt: skip
    assert build.returncode != 0
    assert "CODE_PACK=1 but the base image has no bubblewrap" in build.stdout + build.stderr
