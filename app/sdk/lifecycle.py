"""A pack's settings (SPARRING_<PACK>_*) and its lifespan: the resources it holds while an app serves it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic_settings import BaseSettings, SettingsConfigDict

from app.sdk.errors import ToolDefinitionError

T = TypeVar("T")
S = TypeVar("S", bound="PackSettings")


def env_prefix(pack_name: str) -> str:
    """`SPARRING_<PACK>_`: the prefix of a pack's environment variables (`code` → `SPARRING_CODE_`)."""
    return f"SPARRING_{pack_name.upper().replace('-', '_')}_"


def pack_settings_config(pack_name: str) -> SettingsConfigDict:
    """The `model_config` of a pack's settings model: variables `SPARRING_<PACK>_<FIELD>`, no .env file."""
    # populate_by_name: settings given in code use the field's name even when it has an older alias.
    return SettingsConfigDict(
        env_prefix=env_prefix(pack_name), env_file=None, extra="ignore", populate_by_name=True
    )


class PackSettings(BaseSettings):
    """A pack's own settings. Subclass it with `model_config = pack_settings_config("<pack>")`.

    The server builds it (app/config.py, the one reader of the environment) when it starts the pack;
    a variable that predates the prefix stays readable through `validation_alias=AliasChoices(...)`.
    """

    model_config = SettingsConfigDict(env_file=None, extra="ignore")


@dataclass(frozen=True)
class PackStart(Generic[S]):
    """What a pack's lifespan receives: its settings and what it needs to know about the server."""

    settings: S
    home: Path  # SPARRING_HOME: a pack's caches live under <home>/packs/<pack>
    binds_loopback: bool  # the server listens on a loopback address only

    def cache_dir(self, pack_name: str) -> Path:
        return self.home / "packs" / pack_name


PackLifespan = Callable[[PackStart[Any]], AbstractAsyncContextManager[Any]]


@asynccontextmanager
async def no_resources(start: PackStart[Any]) -> AsyncIterator[None]:
    """The lifespan of a pack that holds nothing."""
    del start
    yield None


def check_settings_model(pack_name: str, model: type[PackSettings]) -> None:
    """ToolDefinitionError unless `model` reads the pack's own prefix (or has no field to read)."""
    if not issubclass(model, PackSettings):
        raise ToolDefinitionError(f"pack {pack_name!r}: settings must subclass app.sdk.PackSettings")
    prefix = model.model_config.get("env_prefix", "")
    if model.model_fields and prefix != env_prefix(pack_name):
        raise ToolDefinitionError(
            f"pack {pack_name!r}: its settings must read {env_prefix(pack_name)}* "
            f"(model_config = pack_settings_config({pack_name!r})), not {prefix or 'unprefixed'} variables"
        )


def resource_as(resources: object, kind: type[T], *, user: str) -> T:
    """`resources` typed as `kind`; a clear error if the pack's lifespan yielded something else."""
    if not isinstance(resources, kind):
        raise ToolDefinitionError(
            f"{user} expected its pack's resources to be a {kind.__name__}, got {type(resources).__name__} "
            "(is the pack started, and does its lifespan yield one?)"
        )
    return resources
