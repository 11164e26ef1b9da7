"""The server's simulated user: the model of SPARRING_USER_MODEL, reached through the remote rollouts'
guarded HTTP client, so it is held to the same egress rule (SPARRING_REMOTE_ALLOWED_HOSTS), answer cap
and connection pool as their model calls.

`build_user` returns None when no user model is set: rows with a user scenario then play as before
(the agent reads the row's one customer message). Whoever runs a rollout wraps the user's model with
`app.remote.runner.contained`, so that a failure reaches the caller in sparring's words, never the
endpoint's.
"""

from __future__ import annotations

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from app.config import Settings
from sparring.policies import ChatPolicy, DeadlinePolicy
from sparring.usersim import SimulatedUser


def build_user(settings: Settings, http: DefaultAsyncHttpxClient) -> SimulatedUser | None:
    """The simulated user the settings describe, on `http` (the guarded model client); None when
    SPARRING_USER_MODEL is unset."""
    if settings.user_model is None:
        return None
    key = settings.user_api_key.get_secret_value() if settings.user_api_key is not None else None
    client = AsyncOpenAI(
        base_url=settings.user_base_url,
        api_key=key or "none",
        http_client=http,
        timeout=settings.user_timeout_seconds,
        max_retries=2,
    )
    model = ChatPolicy(client, settings.user_model, temperature=settings.user_temperature)
    return SimulatedUser(
        model=DeadlinePolicy(model, settings.user_timeout_seconds),
        name=settings.user_model,
        max_steps=settings.user_max_steps,
    )
