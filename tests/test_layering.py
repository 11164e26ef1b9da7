"""The house's layering, read from the imports: who may import whom."""

from __future__ import annotations

import ast
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


def test_the_rollout_runner_is_a_client_of_the_server() -> None:
    """The runner reaches the server over HTTP only: of `app` it imports its own package, the settings,
    the command helpers and the wire identity (how the server names items and runs), nothing else."""
    allowed = ("app.runner", "app.config", "app.cli_support", "app.rollouts.identity")
    bad = {
        str(path.relative_to(ROOT)): sorted(
            m
            for m in modules_imported(path)
            if is_under(m, "app") and not any(is_under(m, a) for a in allowed)
        )
        for path in files("app/runner")
    }
    assert {path: hits for path, hits in bad.items() if hits} == {}
    assert "app.rollouts.identity" in modules_imported(ROOT / "app/runner/evaluate.py")  # the check sees it
