"""What every `sparring` command shares: settings that fail with a readable message, and exits."""

from __future__ import annotations

import typer

from app.config import Settings, get_settings


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print `error: message` to stderr and return the Exit to raise (2: usage or config, 1: failure)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def load_settings() -> Settings:
    try:
        return get_settings()
    except Exception as exc:  # pydantic's message names the bad setting
        raise fail(f"invalid settings: {exc}") from exc
