"""The README's first examples, run as written against a server started the way `make run` starts one.

Each test works in a fresh directory that looks like a checkout (its `.venv` is this one's) and starts
the Makefile's `run` recipe there, so the home is `.sparring/` and the key is `.sparring/admin.key`,
as a new user has them. Two things differ from a user's machine, and only these: the server listens
on a free port (`SPARRING_PORT`, which the README documents) instead of 8000, so the examples' URLs
are pointed at it; and the model of the local-model eval is the tests' scripted model server instead
of one at 127.0.0.1:11434 (the OpenAI example, which needs an OpenAI key, is not run).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.runner.model_server import ModelServer
from tests.runner.test_retail import (
    GoldModel,
    retail_data,  # noqa: F401  (a fixture: the tests' retail data)
    with_writes_and_facts,
)
from tests.system.helpers import ROOT, clean_env, free_port, terminate

README = (ROOT / "README.md").read_text(encoding="utf-8")
DEFAULT_URL = "http://127.0.0.1:8000"
LOCAL_MODEL_URL = "http://127.0.0.1:11434/v1"


def block(language: str, containing: str) -> str:
    """The one fenced block of `language` in the README that contains `containing`."""
    found = [b for b in re.findall(rf"```{language}\n(.*?)```", README, re.S) if containing in b]
    assert len(found) == 1, f"{len(found)} {language} blocks of the README contain {containing!r}"
    return found[0]


def commands(text: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comment-only lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [
        line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]


def json_values(text: str) -> list[Any]:
    """The JSON values curl printed one after the other (no newline between them)."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(text):
        if text[at].isspace():
            at += 1
            continue
        value, at = decoder.raw_decode(text, at)
        values.append(value)
    return values


def run_recipe() -> str:
    """The Makefile's `run` recipe, with `$(BIN)` as the checkout's `.venv/bin`."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(r"^run:.*\n\t(.+)$", makefile, re.M)
    assert recipe is not None, "the Makefile has no run recipe"
    return recipe.group(1).replace("$(BIN)", ".venv/bin")


class Checkout:
    """A directory that looks like a fresh checkout after `make run`: the shell runs the examples in it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.port = free_port()
        self.env = clean_env(SPARRING_PORT=str(self.port))
        self.server: subprocess.Popen[bytes] | None = None
        (path / ".venv").symlink_to(ROOT / ".venv")

    def here(self, text: str) -> str:
        return text.replace(DEFAULT_URL, f"http://127.0.0.1:{self.port}")

    def sh(self, command: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", self.here(command)], cwd=self.path, env=self.env, capture_output=True,
            text=True, timeout=timeout, check=False,
        )  # fmt: skip

    def export(self, command: str) -> None:
        """`export NAME=VALUE` (the value expanded by the shell here), kept for the next commands."""
        name = command.removeprefix("export ").split("=", 1)[0]
        value = self.sh(f'{command} && printf %s "${name}"').stdout
        self.env[name] = value

    def make_run(self) -> None:
        """`make run &`: the Makefile's recipe, in the background, until the server answers."""
        with (self.path / "server.log").open("wb") as log:
            self.server = subprocess.Popen(
                ["bash", "-c", run_recipe()], cwd=self.path, env=self.env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                assert self.server.poll() is None, (self.path / "server.log").read_text()[-4000:]
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"http://127.0.0.1:{self.port}/healthz").status_code == 200:
                        return
                time.sleep(0.2)
        raise TimeoutError((self.path / "server.log").read_text()[-4000:])

    def run_block(self, text: str) -> list[subprocess.CompletedProcess[str]]:
        """Each command of a block in turn (exports kept); stop at a failure."""
        done = []
        for command in commands(text):
            if command.startswith("export "):
                self.export(command.split("#")[0].strip())
                continue
            result = self.sh(command)
            done.append(result)
            assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return done


@pytest.fixture
def checkout(tmp_path: Path) -> Iterator[Checkout]:
    (tmp_path / "sparring").mkdir()
    made = Checkout(tmp_path / "sparring")
    try:
        yield made
    finally:
        terminate(made.server)  # type: ignore[arg-type]


def test_the_first_calls_and_the_mcp_client_work_on_make_runs_defaults(checkout: Checkout) -> None:
    checkout.make_run()
    first = block("sh", "curl -s http://127.0.0.1:8000/tools/echo")
    echo = checkout.sh("\n".join(commands(first)[:2]))  # KEY=..., then the echo call
    expected = re.search(r"^# (\{.*\})$", first, re.M)
    assert expected is not None and echo.returncode == 0, echo.stderr
    assert json.loads(echo.stdout) == json.loads(expected.group(1))
    calls = checkout.sh("\n".join(commands(first)))  # the whole block
    assert calls.returncode == 0, calls.stderr
    *answers, logged = json_values(calls.stdout)
    note = '{"number":1,"title":"first","body":"a note"}'
    assert [answer["output"] for answer in answers] == ["hi", note]  # call_1 again: its answer replayed
    assert [c["tool"] for c in logged["timeline"]] == ["echo", "add_note"]

    client = block("python", "streamable_http_client(")
    (checkout.path / "mcp_example.py").write_text(checkout.here(client), encoding="utf-8")
    ran = subprocess.run(
        [sys.executable, "mcp_example.py"], cwd=checkout.path, env=checkout.env, capture_output=True,
        text=True, timeout=120, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    shown = re.findall(r"print\(.*\)  # (.+)$", client, re.M)
    assert ran.stdout.splitlines() == shown


def test_the_job_config_example_works_as_written(checkout: Checkout) -> None:
    results = checkout.run_block(block("sh", "sparring dataset-tools --grader retail"))
    job = json.loads(results[0].stdout)
    tools = job["job"]["method"]["reinforcement"]["tools"]
    assert tools and all("/packs/retail/tools/" in tool["server_url"] for tool in tools)
    assert {t["function"]["name"] for t in json.loads(results[1].stdout)} == {t["name"] for t in tools}


@pytest.mark.usefixtures("retail_data")  # the gold calls below replay on the tests' retail data
def test_before_you_train_works_as_written(checkout: Checkout) -> None:
    text = block("sh", "sparring canary --dataset retail-train.jsonl")
    steps = commands(text)
    for command in steps[:1]:
        checkout.export(command)
    assert steps[1].startswith("make run")
    checkout.make_run()
    checkout.export(steps[2].split("#")[0].strip())
    dataset = checkout.path / "retail-train.jsonl"
    assert checkout.sh(steps[3]).returncode == 0 and dataset.exists()
    # Two tasks instead of 74 (the same commands; a shorter run): ones no canary can solve by accident.
    lines = [json.loads(line) for line in dataset.read_text(encoding="utf-8").splitlines()]
    kept = with_writes_and_facts(lines, 2)
    dataset.write_text("".join(json.dumps(line) + "\n" for line in kept), encoding="utf-8")

    canary = checkout.sh(steps[4])
    assert canary.returncode == 0, canary.stdout + canary.stderr
    assert "ok: no canary games the grader, and gold scores" in canary.stdout
    assert "OPENAI_API_KEY=..." in steps[5]  # needs an OpenAI key: not run here
    model = ModelServer().start()
    try:
        model.script = GoldModel(kept)
        evaluated = checkout.sh(steps[6].replace(LOCAL_MODEL_URL, model.base_url))
    finally:
        model.stop()
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    assert re.search(r"^mean reward\s+1\.000", evaluated.stdout, re.M), evaluated.stdout
    assert re.search(r"^pass@3\s+1\.000", evaluated.stdout, re.M), evaluated.stdout
    exported = (checkout.path / "base-qwen3.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(exported) == 6 and all(json.loads(line)["passed"] for line in exported)
    job = checkout.sh(steps[7])
    assert job.returncode == 0 and "/packs/retail/tools/" in job.stdout, job.stderr
    assert len(steps) == 8, "a step was added to the README's block: run it here too"
