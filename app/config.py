"""Settings: the only place that reads the environment (prefix SPARRING_)."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

Scope = Literal["tools", "grader", "admin", "metrics"]
EnvProtocol = Literal["openenv", "ors"]
ENV_PROTOCOLS: tuple[EnvProtocol, ...] = ("openenv", "ors")
# `metrics` reads GET /metrics only (a Prometheus scraper's key); `admin` grants every scope.
SCOPES: tuple[Scope, ...] = ("tools", "grader", "admin", "metrics")

DEFAULT_HOME = Path(".sparring")


@dataclass(frozen=True)
class ApiKey:
    scope: Scope
    secret: SecretStr


def parse_api_keys(raw: str) -> list[ApiKey]:
    """Parse `scope:key,scope:key`; refuse unknown scopes and empty keys with a clear message."""
    keys: list[ApiKey] = []
    for entry in (part.strip() for part in raw.split(",")):
        if not entry:
            continue
        scope, sep, secret = entry.partition(":")
        if not sep:  # the entry is likely a key given without its scope: not repeated in the message
            raise ValueError(
                f"API key entry must look like 'scope:key' (an entry has no scope: {', '.join(SCOPES)})"
            )
        if not secret.strip():
            raise ValueError(
                f"API key entry must look like 'scope:key' (got an entry without a key: {scope!r})"
            )
        if scope not in SCOPES:
            raise ValueError(f"unknown API key scope {scope!r}; expected one of {', '.join(SCOPES)}")
        keys.append(ApiKey(scope=scope, secret=SecretStr(secret.strip())))
    return keys


class Settings(BaseSettings):
    # A refused value is not repeated in the error: it may hold keys or a database password. No setting
    # is infinite or NaN (an infinite expiry or deadline cannot be given to Redis or a timer).
    model_config = SettingsConfigDict(
        env_prefix="SPARRING_", env_file=None, extra="ignore", hide_input_in_errors=True, allow_inf_nan=False
    )

    home: Path = Field(
        DEFAULT_HOME, description="Directory for the embedded database, generated keys and caches."
    )
    database_url: str | None = Field(
        None, description="SQLAlchemy async URL; unset means the SQLite file <home>/sparring.db."
    )
    redis_url: str | None = Field(
        None, description="Redis URL; unset means in-memory state (one process only)."
    )
    redis_cluster: bool = Field(
        False,
        description="SPARRING_REDIS_URL is a seed node of a Redis Cluster (no database number: a cluster "
        "has only db 0); the rest of the cluster is discovered from it.",
    )
    redis_key_prefix: str = Field(
        "sp",
        pattern=r"^[A-Za-z0-9_.:-]{1,64}$",
        description="First part of every Redis key (`<prefix>:{<trace id>}:...`): deployments, or test "
        "runs, sharing one Redis keep apart by it.",
    )
    api_keys: Annotated[str, NoDecode] = Field("", description="Comma-separated scope:key entries.")
    auth_header: str = Field(
        "Authorization",
        pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$",  # an HTTP header name (RFC 9110 token)
        description="Header carrying the key ('Bearer <key>' for Authorization).",
    )
    max_body_bytes: int = Field(1024 * 1024, ge=1024)
    max_output_bytes: int = Field(256 * 1024, ge=256)
    packs: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["demo"])
    state_ttl_seconds: int = Field(
        24 * 3600, ge=1, description="Idle time after which a rollout's state expires."
    )
    # Held locks and claims are extended every third of the shorter expiry while their call runs,
    # so these only bound how long a killed worker blocks its rollout.
    lock_timeout_seconds: float = Field(
        5.0, gt=0, description="Expiry of a rollout lock held by a crashed worker (kept alive while it runs)."
    )
    tool_timeout_seconds: float = Field(300.0, gt=0, description="Deadline given to each tool call.")
    claim_timeout_seconds: float = Field(
        5.0,
        gt=0,
        description="Expiry of a call's ledger claim held by a crashed worker (kept alive while it runs).",
    )
    workers: int = Field(1, ge=1, description="Worker processes for `sparring serve` (> 1 needs Redis).")
    log_queue_size: int = Field(10_000, ge=1, description="Call-log rows waiting for a commit before 503.")
    log_batch_size: int = Field(500, ge=1)
    retry_after_seconds: int = Field(2, ge=1)
    redis_max_connections: int = Field(64, ge=1)
    db_pool_size: int = Field(10, ge=1)
    debug: bool = Field(
        False, description="Show the traceback of a start-up error (`sparring serve --debug`), not one line."
    )
    docs_public: bool = Field(False, description="Serve /docs and /openapi.json without an admin key.")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="TCP port `sparring serve` binds.")
    worker_name: str | None = None
    graders_file: Path | None = Field(
        None, description="YAML or JSON file of grader name -> config, served at /grade/{name}."
    )
    default_grader: str | None = Field(
        None, description="Grader of POST /grade (default: the only configured grader, if just one)."
    )
    forwarded_allow_ips: str = Field(
        "127.0.0.1", description="Proxy addresses trusted for X-Forwarded-* headers."
    )
    header_timeout_seconds: float = Field(
        10.0, gt=0, description="Time a connection has to send a request's headers (`sparring serve`)."
    )
    body_timeout_seconds: float = Field(
        60.0, gt=0, description="Time a request has to send its whole body, else 408 (`sparring serve`)."
    )
    keepalive_timeout_seconds: int = Field(
        5, ge=1, description="Idle time after which a keep-alive connection is closed (`sparring serve`)."
    )
    access_log: bool = Field(
        False, description="uvicorn's line per request (every tool call is in the call log already)."
    )
    public_base_url: str | None = Field(
        None, description="Public https URL used in generated job configs (and allowed as the MCP Host)."
    )
    mcp_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Extra Host header values /mcp accepts (`host:port`, `host:*`)."
    )
    mcp_allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Extra Origin header values /mcp accepts (`https://host`)."
    )

    metrics_dir: str | None = Field(
        None,
        validation_alias=AliasChoices("PROMETHEUS_MULTIPROC_DIR", "SPARRING_METRICS_DIR"),
        description="Directory shared by worker processes for metrics (set by `sparring serve --workers N`).",
    )

    # Tracing (OpenTelemetry, OTLP over HTTP): on when either standard endpoint variable is set. The
    # SDK reads the other standard OTEL_* variables (headers, timeout, sampler, resource) itself.
    otel_exporter_otlp_endpoint: str | None = Field(
        None,
        validation_alias=AliasChoices("OTEL_EXPORTER_OTLP_ENDPOINT"),
        description="OTLP/HTTP collector base URL (traces go to <endpoint>/v1/traces); turns tracing on.",
    )
    otel_exporter_otlp_traces_endpoint: str | None = Field(
        None,
        validation_alias=AliasChoices("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        description="OTLP/HTTP traces URL, used as given; turns tracing on.",
    )
    otel_service_name: str = Field(
        "sparring",
        validation_alias=AliasChoices("OTEL_SERVICE_NAME"),
        description="The traces' service.name.",
    )
    trace_content: bool = Field(
        False,
        description="Put tool-call arguments and results on the spans (they may hold user data).",
    )
    trace_content_max_chars: int = Field(
        4096, ge=16, description="Arguments and results on spans are cut to this many characters."
    )

    # Graders
    judge_base_url: str | None = Field(None, description="OpenAI-compatible base URL for model graders.")
    judge_api_key: SecretStr | None = Field(None, description="API key for the judge endpoint.")
    judge_timeout_seconds: float = Field(60.0, gt=0)
    judge_max_retries: int = Field(3, ge=0)
    python_grader_timeout_seconds: float = Field(10.0, gt=0)
    python_grader_memory_mb: int = Field(512, ge=64)
    python_grader_workers: int = Field(2, ge=1)

    # Remote rollouts (eval-protocol's remote rollout processor)
    remote_prefix: str = Field(
        "/remote", description="Path prefix of POST <prefix>/init and GET <prefix>/status."
    )
    remote_open: bool = Field(
        False,
        description="Serve the remote routes without a key (eval-protocol sends none); needs a secret "
        "segment of at least 24 characters in SPARRING_REMOTE_PREFIX.",
    )
    remote_max_concurrent: int = Field(
        64, ge=1, description="Remote rollouts one worker runs at once; /init answers 503 beyond."
    )
    remote_grader: str | None = Field(
        None, description="Grader run at the end of a remote rollout whose init request carries the item."
    )
    remote_lease_seconds: float = Field(
        30.0,
        gt=0,
        description="A running remote rollout whose worker stopped renewing it for this long failed.",
    )
    remote_max_turns: int = Field(50, ge=1, description="Model turns of a remote rollout at most.")
    remote_deadline_seconds: float = Field(
        120.0,
        gt=0,
        description="Deadline of one attempt of a remote rollout, from its /init: past it the rollout is "
        "stopped and ends as a deadline failure (code 4, posted to the gateway). eval-protocol's "
        "processor stops waiting after its timeout_seconds (120 s by default): raise both together.",
    )
    remote_model_timeout_seconds: float = Field(
        300.0,
        gt=0,
        description="Deadline of one model call of a remote rollout, from the request to the answer's "
        "last byte, the client's retries included.",
    )
    remote_model_max_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="Largest model answer a remote rollout reads; past it, it fails.",
    )
    remote_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Hosts (names or addresses) the model and status-log URLs of /remote/init may reach "
        "even when they are not public (loopback, private, link-local); e.g. 127.0.0.1 for local work.",
    )

    # The simulated user (sparring.usersim) of remote rollouts and episodes, for rows with a user scenario
    user_model: str | None = Field(
        None, description="Chat model that plays the customer of rows with a user scenario (unset: no user)."
    )
    user_base_url: str | None = Field(
        None,
        description="OpenAI-compatible base URL of the user model (default: OpenAI); a non-public host "
        "must be listed in SPARRING_REMOTE_ALLOWED_HOSTS, as the remote rollouts' model URLs are.",
    )
    user_api_key: SecretStr | None = Field(None, description="API key of the user model endpoint.")
    user_temperature: float = Field(0.0, ge=0.0, description="Sampling temperature of the user model.")
    user_max_steps: int = Field(
        200, ge=1, description="Steps of a conversation with the user before it ends (τ²'s count)."
    )
    user_timeout_seconds: float = Field(
        300.0, gt=0, description="Deadline of one user model call, the client's retries included."
    )
    user_tool: bool = Field(
        False,
        description="Offer the tool send_message_to_user (the simulated user's reply is its output) in "
        "the packs with user scenarios, for tool-only hosted loops; needs SPARRING_USER_MODEL.",
    )

    # Episode protocols (app/episodes): OpenEnv under /openenv/<pack>, ORS at the origin root
    env_protocols: Annotated[list[EnvProtocol], NoDecode] = Field(
        default_factory=lambda: list(ENV_PROTOCOLS),
        description="Episode protocols served: `openenv`, `ors`, both (the default) or none (empty).",
    )
    ors_default_env: str | None = Field(
        None,
        description="Pack of an ORS `/create` that names none (ors-sdk sends none with split/index); "
        "default: the first enabled pack that ships tasks.",
    )
    episode_ttl_seconds: float = Field(
        1800.0, gt=0, description="Idle time after which an episode session (OpenEnv, ORS) is closed."
    )

    # Run audit (sparring audit, GET /review/api/runs/{run}/audit): when a signal fires
    audit_min_rollouts: int = Field(
        20, ge=4, description="Fewer graded rollouts in a run than this: the audit fires no signal."
    )
    audit_windows: int = Field(
        5, ge=2, le=50, description="Windows of equal numbers of rollouts, in arrival order; first vs last."
    )
    audit_reward_rise: float = Field(
        0.1, gt=0, description="A reward rise (last window minus first) at least this is a rise."
    )
    audit_drop: float = Field(
        0.5, gt=0, lt=1, description="Tool calls or distinct tools per rollout falling by this share."
    )
    audit_length_ratio: float = Field(
        2.0, gt=1, description="Answer length changing by this factor (either way) while reward rises."
    )
    audit_rate_rise: float = Field(
        0.1, gt=0, le=1, description="Tool error rate or flagged share rising by this much (absolute)."
    )
    audit_dominant_share: float = Field(
        0.8, gt=0.5, le=1, description="One grader component's share of the summed sub-scores."
    )
    audit_variance_drop: float = Field(
        0.8, gt=0, lt=1, description="Within-item score spread falling by this share (groups collapse)."
    )

    @field_validator(
        "packs",
        "mcp_allowed_hosts",
        "mcp_allowed_origins",
        "remote_allowed_hosts",
        "env_protocols",
        mode="before",
    )
    @classmethod
    def _split_lists(cls, value: object) -> object:
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value

    @field_validator("api_keys")
    @classmethod
    def _check_keys(cls, value: str) -> str:
        parse_api_keys(value)
        return value

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str | None) -> str | None:
        """An SQLAlchemy URL with an async driver: refused here, not as the driver's traceback at start."""
        if not value:
            return None
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError, NoSuchModuleError

        expected = "e.g. postgresql+asyncpg://user:password@host/db or sqlite+aiosqlite:///path/to/file.db"
        try:
            dialect = make_url(value).get_dialect()
        except (ArgumentError, NoSuchModuleError):
            raise ValueError(
                f"SPARRING_DATABASE_URL is not a database URL SQLAlchemy knows ({expected})"
            ) from None
        if not dialect.is_async:
            raise ValueError(f"SPARRING_DATABASE_URL must name an async driver ({expected})")
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str | None) -> str | None:
        if not value:
            return None
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                "SPARRING_REDIS_URL must start with redis://, rediss:// or unix:// (e.g. redis://host:6379/0)"
            )
        return value

    @field_validator("otel_exporter_otlp_endpoint", "otel_exporter_otlp_traces_endpoint")
    @classmethod
    def _check_otlp_endpoint(cls, value: str | None) -> str | None:
        """OTLP over HTTP: an http(s) URL, else every span would be lost to a failing export."""
        if not value:
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError(
                "an OTLP endpoint must be an http:// or https:// URL (OTLP over HTTP, e.g. "
                "http://collector:4318)"
            )
        return value

    @field_validator("remote_prefix")
    @classmethod
    def _check_remote_prefix(cls, value: str) -> str:
        prefix = "/" + value.strip("/")
        if prefix == "/" or any(c in prefix for c in "?#{} "):
            raise ValueError("SPARRING_REMOTE_PREFIX must be a path such as /remote")
        return prefix

    @model_validator(mode="after")
    def _check_remote_open(self) -> Settings:
        if self.remote_open and not any(len(part) >= 24 for part in self.remote_prefix.split("/")):
            raise ValueError(
                "SPARRING_REMOTE_OPEN serves rollouts without a key, so its prefix must be secret: set "
                "SPARRING_REMOTE_PREFIX to a path with a random segment of at least 24 characters, "
                "e.g. /remote/<random>"
            )
        if self.user_tool and self.user_model is None:
            raise ValueError(
                "SPARRING_USER_TOOL offers send_message_to_user, whose answer is the simulated user's: "
                "set SPARRING_USER_MODEL (and SPARRING_USER_BASE_URL) too"
            )
        return self

    @property
    def keys(self) -> list[ApiKey]:
        return parse_api_keys(self.api_keys)

    @property
    def effective_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{(self.home / 'sparring.db').resolve()}"

    @property
    def is_embedded_db(self) -> bool:
        return self.effective_database_url.startswith("sqlite")

    @property
    def tracing(self) -> bool:
        """Whether spans are exported: an OTLP endpoint is set (OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT)."""
        return bool(self.otel_exporter_otlp_endpoint or self.otel_exporter_otlp_traces_endpoint)

    @property
    def binds_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


@lru_cache
def get_settings() -> Settings:
    return Settings()


PackSettingsT = TypeVar("PackSettingsT", bound=BaseSettings)


def load_pack_settings(
    model: type[PackSettingsT], overrides: Mapping[str, Any] | None = None
) -> PackSettingsT:
    """A pack's own settings: `overrides` (given in code), else its `SPARRING_<PACK>_*` variables, else
    its defaults. A pack declares the model (app/sdk PackSettings); only this module reads the environment."""
    unknown = sorted(set(overrides or {}) - set(model.model_fields))
    if unknown:  # the model ignores unknown variables, so a misspelt override would pass unnoticed
        raise ValueError(f"unknown settings {', '.join(unknown)} (known: {', '.join(model.model_fields)})")
    return model(**dict(overrides or {}))


class ClientKeys(BaseSettings):
    """The keys `sparring eval` and `sparring canary` send to a sparring server: `SPARRING_TOOLS_KEY` and
    `SPARRING_GRADER_KEY` (the placeholders `job-config` prints), or one `SPARRING_KEY` for both."""

    model_config = SettingsConfigDict(env_prefix="SPARRING_", env_file=None, extra="ignore")

    key: SecretStr | None = None
    tools_key: SecretStr | None = None
    grader_key: SecretStr | None = None

    def for_scope(self, scope: Scope) -> str | None:
        specific = {"tools": self.tools_key, "grader": self.grader_key}.get(scope)
        chosen = specific or self.key
        return chosen.get_secret_value() if chosen is not None else None

    def placeholders(self) -> dict[str, str]:
        """Values for the `<SPARRING_TOOLS_KEY>` / `<SPARRING_GRADER_KEY>` placeholders of a job config."""
        values = {
            "SPARRING_TOOLS_KEY": self.for_scope("tools"),
            "SPARRING_GRADER_KEY": self.for_scope("grader"),
        }
        return {name: value for name, value in values.items() if value}


def environment_secret(name: str) -> str | None:
    """The value of the environment variable `name` (the model API key of `sparring eval`), if set."""
    return os.environ.get(name) or None
