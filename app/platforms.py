"""The training platforms a job config is printed for: Microsoft Foundry's job shape (the default) and
OpenAI's (a legacy choice while its hosted fine-tuning closes)."""

from __future__ import annotations

from datetime import date
from typing import Any, Literal

Platform = Literal["foundry", "openai"]
PLATFORMS: tuple[Platform, ...] = ("foundry", "openai")
DEFAULT_PLATFORM: Platform = "foundry"

# OpenAI's deprecations page (notice of 2026-05-07). Agent RFT's base model gpt-5, and every fine-tune
# of it, shuts down on GPT5_SHUTDOWN; o4-mini already did on O4_MINI_SHUTDOWN; self-serve fine-tuning
# takes no new training jobs from OPENAI_FINE_TUNING_CUTOFF on (jobs created before it run to completion).
GPT5_SHUTDOWN = date(2026, 12, 11)
O4_MINI_SHUTDOWN = date(2026, 10, 23)
OPENAI_FINE_TUNING_CUTOFF = date(2027, 1, 6)
OPENAI_CLOSING = (
    f"OpenAI's Agent RFT is closing: gpt-5 and its fine-tunes shut down on {GPT5_SHUTDOWN}, o4-mini shut "
    f"down on {O4_MINI_SHUTDOWN}, and self-serve fine-tuning takes no new jobs from "
    f"{OPENAI_FINE_TUNING_CUTOFF} on"
)

# The Azure OpenAI data-plane version that carries `method.reinforcement` (tools and the endpoint grader
# are private-preview fields of it). A client made by a Foundry project (`AIProjectClient(...)
# .get_openai_client()`) speaks the v1 API and needs no version.
FOUNDRY_API_VERSION = "2025-04-01-preview"

# What Microsoft's Foundry samples use; our endpoints are sized for about 50 requests/s.
FOUNDRY_GRADER_RATE_LIMIT = 50
FOUNDRY_MAX_EPISODE_STEPS = 10
FOUNDRY_HYPERPARAMETERS: dict[str, Any] = {
    "eval_interval": 3,
    "eval_samples": 5,
    "compute_multiplier": 1.0,
    "reasoning_effort": "medium",
}
FOUNDRY_BASE_MODEL = "o4-mini-2025-04-16"


def endpoint_grader_fields(
    grader: dict[str, Any], *, rate_limit: int | None, pass_threshold: float | None
) -> dict[str, Any]:
    """The endpoint grader with the optional `rate_limit` (requests/s) and `pass_threshold` fields."""
    out = dict(grader)
    if rate_limit is not None:
        out["rate_limit"] = rate_limit
    if pass_threshold is not None:
        out["pass_threshold"] = pass_threshold
    return out


def foundry_job(
    block: dict[str, Any], *, model: str | None = None, max_episode_steps: int | None = None
) -> dict[str, Any]:
    """Foundry's whole job: `client.fine_tuning.jobs.create(**job)` with the reinforcement block inside.

    File ids and the base model are placeholders to fill in; `api_version` is what an `AzureOpenAI`
    client needs for these fields.
    """
    reinforcement = {
        "tools": block["tools"],
        "grader": block["grader"],
        "max_episode_steps": max_episode_steps or FOUNDRY_MAX_EPISODE_STEPS,
        "hyperparameters": dict(FOUNDRY_HYPERPARAMETERS),
    }
    return {
        "platform": "foundry",
        "api_version": FOUNDRY_API_VERSION,
        "job": {
            "model": model or FOUNDRY_BASE_MODEL,
            "training_file": "<TRAINING_FILE_ID>",
            "validation_file": "<VALIDATION_FILE_ID>",
            "suffix": "sparring",
            "method": {"type": "reinforcement", "reinforcement": reinforcement},
        },
    }
