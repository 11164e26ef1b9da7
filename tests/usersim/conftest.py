"""The simulated user's fixtures: the runner tests' scripted model server plays the agent and the user."""

from __future__ import annotations

from tests.runner.conftest import backend, model_server, model_server_process, openai_client

__all__ = ["backend", "model_server", "model_server_process", "openai_client"]
