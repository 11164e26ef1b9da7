"""The code pack refuses to start without a working sandbox, and says what to install or allow."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from app.lifespan import StartupError
from tests.conftest import AppFactory, new_trace
from tools.code import pack, runtime, sandbox


async def test_without_bwrap_the_server_refuses_to_start(
    app_factory: AppFactory, code_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_which = shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None if name == "bwrap" else real_which(name))
    with pytest.raises(StartupError) as failure:
        async with app_factory(packs=[pack], code_data=code_data):
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
        async with app_factory(packs=[pack], code_data=code_data):
            pass
    shutil.rmtree(directory)
    assert "No permissions to create new namespace" in str(failure.value)
    assert "user namespaces" in str(failure.value)


async def test_unsafe_local_is_refused_on_a_public_address(code_data: Path, tmp_path: Path) -> None:
    with pytest.raises(sandbox.SandboxUnavailable, match="refused on a non-loopback address"):
        runtime.configure("unsafe-local", python=None, home=tmp_path, binds_loopback=False)


async def test_unsafe_local_runs_code_with_a_loud_warning(
    app_factory: AppFactory, code_data: Path, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.WARNING, logger="sparring.packs.code")
    try:
        async with app_factory(packs=[pack], code_data=code_data, code_sandbox="unsafe-local") as client:
            assert runtime.get_sandbox().mode == "unsafe-local"
            body: dict[str, Any] = {
                "call_id": "c1",
                "trace_id": new_trace(),
                "arguments": {"path": "solution.py", "args": None},
                "item": {"task_id": "HumanEval/0"},
            }
            response = await client.post("/tools/run_python", json=body)
    finally:
        await asyncio.to_thread(runtime.configure, "bwrap", python=None, home=tmp_path, binds_loopback=True)
    assert response.status_code == 200 and '"exit_code":0' in response.json()["output"]
    assert any("WITHOUT ISOLATION" in record.getMessage() for record in caplog.records)
