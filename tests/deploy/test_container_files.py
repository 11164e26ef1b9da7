"""The Dockerfile, docker-compose.yml, .env.example and the entrypoint, checked without a Docker engine."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import AliasChoices, SecretStr
from pydantic_settings import BaseSettings

from app.config import Settings
from app.packs import load_pack
from tests.deploy.procs import REPO, clean_env

COMPOSE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
ENTRYPOINT = REPO / "deploy" / "entrypoint.sh"
CADDYFILE = REPO / "deploy" / "Caddyfile"

# Read by deploy/entrypoint.sh itself rather than by app/config.py (checked below).
ENTRYPOINT_ONLY = {"SPARRING_WORKERS"}
# Secrets of the stack that are not app settings.
STACK_SECRETS = {"POSTGRES_PASSWORD"}
SPARRING_NAME = re.compile(r"\bSPARRING_[A-Z0-9_]*[A-Z0-9]\b")
COMPOSE_REFERENCE = re.compile(r"\$\{(\w+)((?::?[-?+])[^}]*)?\}")


def env_names(field_name: str, model: type[BaseSettings] = Settings) -> set[str]:
    field = model.model_fields[field_name]
    if isinstance(field.validation_alias, AliasChoices):
        return {c for c in field.validation_alias.choices if isinstance(c, str)}
    prefix = model.model_config.get("env_prefix", "")
    return {f"{prefix}{field_name}".upper()}


# The shipped packs' own settings (SPARRING_<PACK>_*), read when the server starts them.
PACK_SETTINGS = [load_pack(name).settings_model for name in ("demo", "retail", "airline", "telecom", "code")]
SETTING_NAMES = {
    name
    for model in (Settings, *PACK_SETTINGS)
    for field in model.model_fields
    for name in env_names(field, model)
}


def secret_names() -> set[str]:
    names = set(STACK_SECRETS)
    for field_name, field in Settings.model_fields.items():
        is_secret_type = SecretStr in (field.annotation, *typing.get_args(field.annotation))
        if is_secret_type or re.search(r"(^|_)(keys?|password|secret|token)$", field_name):
            names |= env_names(field_name)
    return names


def env_example() -> dict[str, str]:
    """Every NAME=value line of .env.example, commented out or not."""
    entries = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        match = re.match(r"^#?\s*([A-Z][A-Z0-9_]*)=(.*)$", line)
        if match:
            entries[match.group(1)] = match.group(2).strip()
    return entries


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def service(compose: dict[str, Any], name: str) -> dict[str, Any]:
    assert name in compose["services"], f"no {name} service"
    return dict(compose["services"][name])


def healthcheck_command(svc: dict[str, Any]) -> str:
    test = svc.get("healthcheck", {}).get("test")
    assert test, "no health check"
    return test if isinstance(test, str) else " ".join(test)


def test_compose_has_the_services_and_their_health_checks(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) >= {"app", "postgres", "redis", "caddy"}
    assert "/healthz" in healthcheck_command(service(compose, "app"))
    assert "pg_isready" in healthcheck_command(service(compose, "postgres"))
    assert "redis-cli ping" in healthcheck_command(service(compose, "redis"))


def test_two_app_replicas_start_after_healthy_postgres_and_redis(compose: dict[str, Any]) -> None:
    app = service(compose, "app")
    assert app["deploy"]["replicas"] == 2
    assert app["build"] == "." or app["build"].get("context") == "."
    for dependency in ("postgres", "redis"):
        assert app["depends_on"][dependency]["condition"] == "service_healthy"
    assert service(compose, "caddy")["depends_on"]["app"]["condition"] == "service_healthy"
    # Replicas cannot share a published port, and the app must only be reached through the proxy.
    assert "ports" not in app and "container_name" not in app
    env = app["environment"]
    assert (
        env["SPARRING_DATABASE_URL"].startswith("postgresql+asyncpg://")
        and "@postgres:5432/" in env["SPARRING_DATABASE_URL"]
    )
    assert env["SPARRING_REDIS_URL"].startswith("redis://redis:6379/")


def test_state_and_log_survive_restarts(compose: dict[str, Any]) -> None:
    redis = service(compose, "redis")
    command = redis["command"] if isinstance(redis["command"], str) else " ".join(redis["command"])
    assert re.search(r"--appendonly\s+yes", command), command
    assert "noeviction" in command
    assert any(str(v).endswith(":/data") for v in redis["volumes"])
    assert any(str(v).endswith(":/var/lib/postgresql/data") for v in service(compose, "postgres")["volumes"])
    named = set(compose.get("volumes") or {})
    for svc in ("redis", "postgres", "caddy"):
        for volume in service(compose, svc)["volumes"]:
            source = str(volume).split(":", 1)[0]
            assert source.startswith("./") or source in named, f"{svc}: volume {source} is not declared"


def with_defaults(value: str) -> str:
    """A compose value with every `${NAME:-default}` replaced by its default."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def test_caddy_terminates_tls_in_front_of_every_replica(compose: dict[str, Any]) -> None:
    caddy = service(compose, "caddy")
    ports = [with_defaults(str(p)) for p in caddy["ports"]]
    assert "443:443" in ports and "80:80" in ports  # 80: for ACME and the HTTPS redirect
    assert (
        "${HTTPS_PORT:-443}:${HTTPS_PORT:-443}" in caddy["ports"] and "${HTTP_PORT:-80}:80" in caddy["ports"]
    )
    mounts = {str(v).split(":")[0]: str(v).split(":")[1] for v in caddy["volumes"]}
    assert mounts.get("./deploy/Caddyfile") == "/etc/caddy/Caddyfile"
    assert (REPO / "deploy" / "Caddyfile").is_file()
    assert "/data" in mounts.values()  # certificates and the internal CA persist
    caddyfile = CADDYFILE.read_text()
    assert "{$SPARRING_PUBLIC_BASE_URL:https://localhost} {" in caddyfile
    assert (
        caddy["environment"]["SPARRING_PUBLIC_BASE_URL"]
        == service(compose, "app")["environment"]["SPARRING_PUBLIC_BASE_URL"]
    )
    assert re.search(r"reverse_proxy\s*\{[^}]*dynamic a \{\s*name app\s*port 8000", caddyfile, re.S)
    assert "lb_policy round_robin" in caddyfile
    # The app trusts forwarded headers from the proxy network only.
    edge = compose["networks"]["edge"]["ipam"]["config"][0]["subnet"]
    assert service(compose, "app")["environment"]["SPARRING_FORWARDED_ALLOW_IPS"] == edge
    assert "edge" in caddy["networks"] and "edge" in service(compose, "app")["networks"]
    assert (
        "edge" not in service(compose, "postgres")["networks"]
        and "edge" not in service(compose, "redis")["networks"]
    )


def test_every_sparring_variable_is_a_setting_and_every_setting_is_documented() -> None:
    entrypoint = ENTRYPOINT.read_text()
    for name in ENTRYPOINT_ONLY - SETTING_NAMES:
        assert f"${{{name}" in entrypoint, (
            f"{name} is allowed as an entrypoint variable but it does not read it"
        )
    allowed = SETTING_NAMES | ENTRYPOINT_ONLY
    for path in (COMPOSE, ENV_EXAMPLE, CADDYFILE, DOCKERFILE, ENTRYPOINT):
        unknown = set(SPARRING_NAME.findall(path.read_text())) - allowed
        assert not unknown, f"{path.name} uses {sorted(unknown)}, which app/config.py does not define"

    documented = env_example()
    for model in (Settings, *PACK_SETTINGS):
        for field in model.model_fields:
            assert env_names(field, model) & set(documented), f"setting {field} is missing from .env.example"
    # Every variable docker-compose.yml interpolates is documented too.
    for name, _ in COMPOSE_REFERENCE.findall(COMPOSE.read_text()):
        assert name in documented, f"docker-compose.yml uses ${{{name}}}, not documented in .env.example"


def test_a_commented_line_of_the_env_file_shows_the_default() -> None:
    """.env.example: "a commented line shows the default and changes nothing": the value the setting
    takes when unset (compose's own `${NAME:-default}` where compose gives one)."""
    compose_defaults = {
        name: modifier[2:]
        for name, modifier in COMPOSE_REFERENCE.findall(COMPOSE.read_text())
        if modifier.startswith(":-")
    }
    commented = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        match = re.match(r"^#\s*([A-Z][A-Z0-9_]*)=(\S+)", line)
        if match:
            commented[match.group(1)] = match.group(2)
    checked = 0
    for model in (Settings, *PACK_SETTINGS):
        for field_name, field in model.model_fields.items():
            for name in env_names(field_name, model) & set(commented):
                default = field.get_default(call_default_factory=True)
                if isinstance(default, list):
                    default = ",".join(default)
                expected = compose_defaults.get(name, default)
                shown = commented[name]
                if isinstance(expected, bool):
                    assert shown == str(expected).lower(), (
                        f".env.example shows {name}={shown}, default {expected}"
                    )
                elif isinstance(expected, int | float):
                    assert float(shown) == expected, f".env.example shows {name}={shown}, default {expected}"
                else:
                    assert shown == str(expected), f".env.example shows {name}={shown}, default {expected}"
                checked += 1
    assert checked > 30


def test_no_secret_has_a_default() -> None:
    secrets = secret_names()
    assert {"SPARRING_API_KEYS", "SPARRING_JUDGE_API_KEY", "POSTGRES_PASSWORD"} <= secrets
    documented = env_example()
    for name in secrets & set(documented):
        assert documented[name] == "", f".env.example gives {name} a value"
    for required in ("SPARRING_API_KEYS", "POSTGRES_PASSWORD"):
        assert re.search(rf"^{required}=$", ENV_EXAMPLE.read_text(), re.M), (
            f"{required} must be set (uncommented)"
        )

    text = COMPOSE.read_text()
    for name, modifier in COMPOSE_REFERENCE.findall(text):
        if name in secrets:
            assert modifier.startswith((":?", "?")), (
                f"docker-compose.yml: ${{{name}{modifier}}} must be required"
            )
    compose = yaml.safe_load(text)
    for svc_name, svc in compose["services"].items():
        env = svc.get("environment") or {}
        for key, value in env.items() if isinstance(env, dict) else (e.split("=", 1) for e in env):
            if key in secrets:
                assert "${" in str(value), f"{svc_name}: {key} has a literal value"
    for line in DOCKERFILE.read_text().splitlines():
        if re.match(r"^\s*(ENV|ARG)\b", line):
            assert not any(name in line for name in secrets), f"Dockerfile bakes a secret: {line}"


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    instructions = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            keyword, _, rest = stripped.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def test_dockerfile_is_multi_stage_non_root_with_a_health_check() -> None:
    instructions = dockerfile_instructions()
    froms = [rest for keyword, rest in instructions if keyword == "FROM"]
    assert len(froms) >= 2 and all(re.search(r"\bAS\s+\w+", f, re.I) for f in froms), froms
    base = dict(rest.split("=", 1) for keyword, rest in instructions if keyword == "ARG" and "=" in rest).get(
        "PYTHON_IMAGE", ""
    )
    assert base.startswith("python:3.11-slim"), base
    assert any(k == "COPY" and "--from=build" in rest for k, rest in instructions)

    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users, "no USER: the image would run as root"
    final_user = users[-1].split(":")[0]
    assert final_user not in ("root", "0"), final_user
    healthchecks = [rest for keyword, rest in instructions if keyword == "HEALTHCHECK"]
    assert len(healthchecks) == 1 and "/healthz" in healthchecks[0] and "urllib" in healthchecks[0]
    assert "curl" not in healthchecks[0]
    entrypoint = [rest for keyword, rest in instructions if keyword == "ENTRYPOINT"]
    assert entrypoint == ['["sparring-entrypoint"]']
    assert any(
        k == "COPY" and "deploy/entrypoint.sh /usr/local/bin/sparring-entrypoint" in r
        for k, r in instructions
    )
    # Dependencies come from pyproject.toml's pins.
    assert any(k == "COPY" and "pyproject.toml" in r for k, r in instructions)


def test_the_build_context_keeps_what_the_image_copies_and_drops_secrets() -> None:
    ignored = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ".env" in ignored and ".git" in ignored and ".venv" in ignored
    for keyword, rest in dockerfile_instructions():
        if keyword != "COPY" or "--from=" in rest:
            continue
        sources = [part for part in rest.split() if not part.startswith("--")][:-1]
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: no such file"
            top = source.split("/")[0]
            assert top not in ignored and source not in ignored, f"COPY {source} but .dockerignore drops it"


def test_entrypoint_waits_migrates_then_serves() -> None:
    script = ENTRYPOINT.read_text()
    assert script.startswith("#!/bin/sh")
    assert ENTRYPOINT.stat().st_mode & 0o111, "deploy/entrypoint.sh is not executable"
    subprocess.run(["sh", "-n", str(ENTRYPOINT)], check=True)
    serve = script.index("wait_for_database\n        sparring db upgrade\n        exec sparring serve")
    assert serve > script.index("wait_for_database() {")
    assert (
        'exec sparring serve --host "${SPARRING_HOST:-0.0.0.0}" --workers "${SPARRING_WORKERS:-2}"' in script
    )


def compose_command() -> list[str] | None:
    """`docker compose` (v2) where the plugin runs, else Debian's `docker-compose` (v1), else None."""
    candidates = [["docker", "compose"]] if shutil.which("docker") else []
    if shutil.which("docker-compose"):
        candidates.append(["docker-compose"])
    for command in candidates:
        try:
            probe = subprocess.run([*command, "version"], capture_output=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return command
    return None


def test_the_project_is_named_in_the_env_file_not_the_compose_file(compose: dict[str, Any]) -> None:
    assert "name" not in compose  # Compose v1 (Debian's docker-compose) refuses a top-level name
    assert env_example()["COMPOSE_PROJECT_NAME"] == "sparring"
    assert {"HTTP_PORT", "HTTPS_PORT"} <= set(env_example())


def test_the_packs_data_is_a_volume(compose: dict[str, Any]) -> None:
    assert "sparring-home:/var/lib/sparring" in service(compose, "app")["volumes"]
    assert "SPARRING_HOME=/var/lib/sparring" in DOCKERFILE.read_text()


def test_the_code_pack_override_carries_its_sandbox_settings() -> None:
    override = yaml.safe_load((REPO / "docker-compose.code.yml").read_text())
    app = override["services"]["app"]
    assert set(app["security_opt"]) == {"seccomp=unconfined", "apparmor=unconfined"}
    assert app["build"]["args"]["CODE_PACK"] == "1"
    assert "code" in app["environment"]["SPARRING_PACKS"]


def test_docker_compose_accepts_the_file(tmp_path: Path) -> None:
    command = compose_command()
    if command is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    env = ENV_EXAMPLE.read_text()
    env = re.sub(r"^SPARRING_API_KEYS=$", "SPARRING_API_KEYS=tools:t1,grader:g1,admin:a1", env, flags=re.M)
    env = re.sub(r"^POSTGRES_PASSWORD=$", "POSTGRES_PASSWORD=0123abcd", env, flags=re.M)
    (tmp_path / ".env").write_text(env)
    # Paths in the file (build context, Caddyfile mount) resolve against the project directory.
    shutil.copy(DOCKERFILE, tmp_path / "Dockerfile")
    shutil.copytree(REPO / "deploy", tmp_path / "deploy")
    result = subprocess.run(
        [*command, "--project-directory", str(tmp_path), "-f", str(COMPOSE),
         "-f", str(REPO / "docker-compose.code.yml"), "--env-file", str(tmp_path / ".env"), "config", "-q"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_caddy_accepts_the_caddyfile() -> None:
    caddy = shutil.which("caddy")
    if caddy is None:
        pytest.skip("caddy is not installed (optional: apt-get install -y caddy validates deploy/Caddyfile)")
    env = clean_env(SPARRING_PUBLIC_BASE_URL="https://sparring.example.com")
    result = subprocess.run(
        [caddy, "adapt", "--config", str(CADDYFILE), "--adapter", "caddyfile", "--validate"],
        capture_output=True, text=True, timeout=30, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    (server,) = config["apps"]["http"]["servers"].values()
    assert server["listen"] == [":443"]
    (route,) = server["routes"]
    assert route["match"] == [{"host": ["sparring.example.com"]}]
    handlers = {h["handler"]: h for r in route["handle"][0]["routes"] for h in r["handle"]}
    proxy = handlers["reverse_proxy"]
    assert proxy["dynamic_upstreams"] == {
        "source": "a",
        "name": "app",
        "port": "8000",
        "refresh": 5_000_000_000,
    }
    assert proxy["load_balancing"]["selection_policy"] == {"policy": "round_robin"}
