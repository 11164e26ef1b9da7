"""The code pack refuses to start without a working sandbox, and says what to install or allow."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from app.lifespan import StartupError
from tests.code.conftest import CodeClient, served_resources
from tests.conftest import ADMIN_KEY, AppFactory, new_trace
from tools.code import pack, runtime, sandbox
from tools.code.runtime import CodeResources


async def test_without_bwrap_the_server_refuses_to_start(
    app_factory: AppFactory, code_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_which = shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None if name == "bwrap" else real_which(name))
    with pytest.raises(StartupError) as failure:
        async with app_factory(packs=[pack], pack_settings={"code": {"data": code_data}}):
            pass
    message = str(failure.value)
    assert message.startswith("pack 'code' cannot start: ")
    assert "apt-get install bubblewrap" in message
    assert "seccomp=unconfined" in message and "SPARRING_CODE_SANDBOX=unsafe-local" in message


def fake_bwrap() -> Path:
    directory = Path(tempfile.mkdtemp(prefix="fake-bwrap-"))
    directory.chmod(0o755)
    fake = directory / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    return fake


async def test_a_bwrap_that_cannot_create_namespaces_is_refused(
    app_factory: AppFactory, code_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A bwrap that fails as it does where user namespaces are not allowed (in a directory the sandbox
    # user can enter: a root server starts bwrap as an unprivileged uid).
    fake = fake_bwrap()
    directory = fake.parent
    real_which = shutil.which
    monkeypatch.setattr(
        sandbox.shutil, "which", lambda name: str(fake) if name == "bwrap" else real_which(name)
    )
    with pytest.raises(StartupError) as failure:
        async with app_factory(packs=[pack], pack_settings={"code": {"data": code_data}}):
            pass
    shutil.rmtree(directory)
    assert "No permissions to create new namespace" in str(failure.value)
    assert "user namespaces" in str(failure.value)


async def test_unsafe_local_is_refused_on_a_public_address(app_factory: AppFactory, code_data: Path) -> None:
    with pytest.raises(StartupError, match="refused on a non-loopback address"):
        async with app_factory(
            packs=[pack],
            host="0.0.0.0",
            api_keys="tools:k",
            pack_settings={"code": {"data": code_data, "sandbox": "unsafe-local"}},
        ):
            pass


async def test_unsafe_local_runs_code_with_a_loud_warning(
    app_factory: AppFactory,
    code_data: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.WARNING, logger="sparring.packs.code")
    # Today's variable name, read by the pack's own settings (prefix SPARRING_CODE_).
    monkeypatch.setenv("SPARRING_CODE_SANDBOX", "unsafe-local")
    async with app_factory(packs=[pack], pack_settings={"code": {"data": code_data}}) as client:
        resources = served_resources(client)["code"]
        assert isinstance(resources, CodeResources) and resources.sandbox.mode == "unsafe-local"
        body: dict[str, Any] = {
            "call_id": "c1",
            "trace_id": new_trace(),
            "arguments": {"path": "solution.py", "args": None},
            "item": {"task_id": "HumanEval/0"},
        }
        response = await client.post("/tools/run_python", json=body)
    assert response.status_code == 200 and '"exit_code":0' in response.json()["output"]
    assert any("WITHOUT ISOLATION" in record.getMessage() for record in caplog.records)


async def test_the_sandbox_is_built_once_per_app_and_removed_when_it_stops(
    app_factory: AppFactory, code_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[sandbox.Sandbox] = []
    real_create = runtime.create

    def create(*args: Any, **kwargs: Any) -> sandbox.Sandbox:
        built.append(real_create(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(runtime, "create", create)
    async with app_factory(
        packs=[pack], key=ADMIN_KEY, pack_settings={"code": {"data": code_data}}
    ) as client:
        code = CodeClient(client)
        for _ in range(2):
            trace = new_trace()
            assert (await code.run(trace, "solution.py", task_id="HumanEval/0"))["exit_code"] == 0
        _, score = await code.solve(
            "HumanEval/0", "def has_close_elements(numbers, threshold):\n    return 1\n"
        )
        assert score == 0.0  # the grade ran in the same sandbox
        assert len(built) == 1 and built[0].root.is_dir()
        resources = served_resources(client)["code"]
        assert isinstance(resources, CodeResources) and resources.sandbox is built[0]
    assert not built[0].root.exists()  # closed with the app, not at the process's exit
