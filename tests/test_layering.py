"""The house's layering, read from the imports: who may import whom."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def modules_imported(path: Path) -> set[str]:
    """Every module a file imports (at any depth: imports inside functions count too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def offending(folder: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad: dict[str, list[str]] = {}
    for path in files(folder):
        hits = sorted(m for m in modules_imported(path) if m.startswith(forbidden))
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    return bad


def is_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("app/grading", ("app.review", "app.calls")),  # the grade path stands alone
        ("app/rollouts", ("app.calls", "app.grading", "app.review")),  # rollouts are below both paths
        ("app/calls", ("app.grading", "app.review")),
        ("app/sdk", ("app.calls", "app.grading", "app.review", "app.rollouts", "app.db")),
    ],
)
def test_a_layer_imports_nothing_above_it(folder: str, forbidden: tuple[str, ...]) -> None:
    assert offending(folder, forbidden) == {}


def test_packs_import_only_the_sdk() -> None:
    bad = {
        str(path.relative_to(ROOT)): sorted(
            m for m in modules_imported(path) if is_under(m, "app") and not is_under(m, "app.sdk")
        )
        for path in files("tools")
    }
    assert {path: hits for path, hits in bad.items() if hits} == {}


def test_only_app_deps_reads_the_app_state() -> None:
    readers = []
    for path in files("app"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "state":
                owner = node.value
                if (isinstance(owner, ast.Name) and owner.id == "app") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "app"
                ):
                    readers.append(str(path.relative_to(ROOT)))
    assert sorted(set(readers)) == ["app/deps.py"]


def test_the_checks_see_real_imports() -> None:
    """The reader itself: it finds the imports this very layering forbids when they are there."""
    assert "app.grading.service" in modules_imported(ROOT / "app/grading/routes.py")
    assert offending("app/review", ("app.grading",)) != {}  # review reads what grading writes


def test_the_client_package_imports_nothing_of_the_server() -> None:
    """`sparring/` is the bottom of the house: the contract and the client. It imports no `app` and no
    `tools`; the server imports it, never the other way round."""
    bad = {
        str(path.relative_to(ROOT)): sorted(
            m for m in modules_imported(path) if is_under(m, "app") or is_under(m, "tools")
        )
        for path in files("sparring")
    }
    assert {path: hits for path, hits in bad.items() if hits} == {}
    assert "sparring.wire" in modules_imported(ROOT / "app/remote/schemas.py")  # the server sits on it


def server_only_modules() -> list[str]:
    """The top-level modules of the `server` extra's distributions (and `app`, `tools`): what an install
    of the client alone does not hold."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    client = {canonical(requirement) for requirement in project["dependencies"]}
    server = {canonical(requirement) for requirement in project["optional-dependencies"]["server"]} - client
    modules = {"app", "tools"}
    for module, distributions in importlib.metadata.packages_distributions().items():
        if any(canonical(d) in server for d in distributions):
            modules.add(module)
    return sorted(modules)


def canonical(requirement: str) -> str:
    name = re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


CLIENT_MODULES = (
    "sparring.wire",
    "sparring.loop",
    "sparring.http",
    "sparring.policies",
    "sparring.canaries",
    "sparring.evaluate",
    "sparring.session",
    "sparring.report",
    "sparring.client",
    "sparring.tracing",
    "sparring.usersim",
)

BLOCKER = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class ServerStack(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"the client imported {name}, which only the server installs")
        return None
sys.meta_path.insert(0, ServerStack())
import importlib
for module in sys.argv[2].split(","):
    importlib.import_module(module)
print(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
"""


def import_without_the_server(
    modules: tuple[str, ...], blocked: list[str]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER, ",".join(blocked), ",".join(modules)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


def test_the_client_imports_where_the_server_stack_is_not_installed() -> None:
    """`pip install sparring` holds the client's own dependencies only: every client module imports in
    a process where the server extra's packages (FastAPI, SQLAlchemy, Redis, ...) cannot be imported."""
    blocked = server_only_modules()
    assert {"fastapi", "sqlalchemy", "redis", "uvicorn", "alembic", "app", "tools"} <= set(blocked)
    done = import_without_the_server(CLIENT_MODULES, blocked)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_blocker_stops_a_server_import() -> None:
    """The check itself: a module of the server fails to import in that process."""
    done = import_without_the_server(("app.remote.schemas",), server_only_modules())
    assert done.returncode != 0 and "which only the server installs" in done.stderr
