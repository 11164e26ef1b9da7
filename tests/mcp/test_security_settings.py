"""Which Host and Origin values /mcp accepts, from the settings (the SDK's DNS-rebinding checks)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from app.mcp.http import transport_security
from tests.conftest import make_settings


def test_loopback_server_accepts_only_loopback_names(tmp_path: Path) -> None:
    security = transport_security(make_settings(tmp_path))
    assert security.enable_dns_rebinding_protection
    assert "127.0.0.1:*" in security.allowed_hosts and "localhost:*" in security.allowed_hosts
    assert not any("example" in h for h in security.allowed_hosts + security.allowed_origins)


def test_public_base_url_and_extra_names_are_allowed(tmp_path: Path) -> None:
    settings = make_settings(
        tmp_path,
        host="0.0.0.0",
        public_base_url="https://sparring.example.com",
        mcp_allowed_hosts="internal.example:8000, mcp.example:*",
        mcp_allowed_origins="https://app.example",
    )
    security = transport_security(settings)
    assert security.enable_dns_rebinding_protection
    assert {"sparring.example.com", "internal.example:8000", "mcp.example:*"} <= set(security.allowed_hosts)
    assert {"https://sparring.example.com", "https://app.example"} <= set(security.allowed_origins)


def test_a_public_bind_without_names_turns_the_checks_off(tmp_path: Path) -> None:
    security = transport_security(make_settings(tmp_path, host="0.0.0.0"))
    assert not security.enable_dns_rebinding_protection


def test_allowed_origins_without_an_allowed_host_say_they_are_not_applied(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK checks Host and Origin together: origins alone cannot turn them on, and the log says so
    rather than leaving the operator to believe they are checked."""
    settings = make_settings(tmp_path, host="0.0.0.0", mcp_allowed_origins="https://app.example")
    with caplog.at_level(logging.WARNING, logger="app.mcp.http"):
        security = transport_security(settings)
    assert not security.enable_dns_rebinding_protection
    assert "SPARRING_MCP_ALLOWED_ORIGINS is not applied" in caplog.text
