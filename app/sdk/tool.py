"""Declaring tools: a typed function becomes a tool whose JSON schema comes from its signature."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin, overload

import openai
from pydantic import BaseModel, ConfigDict, PydanticSchemaGenerationError, ValidationError, create_model
from pydantic.errors import PydanticInvalidForJsonSchema, PydanticUserError

from app.sdk.checks import CheckResult, RolloutView, StateCheck
from app.sdk.context import ToolContext
from app.sdk.errors import ToolDefinitionError
from app.sdk.lifecycle import PackLifespan, PackSettings, check_settings_model, no_resources
from app.sdk.state import EMPTY_BASE, Base

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=StateCheck)
# `fn(resources, split, out) -> lines written`, run while the pack is started (its data located).
DatasetBuilder = Callable[[Any, str, Path], int]
# `fn(resources) -> base`: the records every rollout starts from, loaded once when the pack starts.
BaseLoader = Callable[[Any], Base]
# `fn(resources, item) -> scenario`: what a simulated user plays for a dataset row that does not carry
# it, in the row's `user_simulator` form (sparring.usersim: scenario, guidelines, tools); None: none.
ScenarioLoader = Callable[[Any, Mapping[str, Any]], Any]
# `fn(resources, item) -> {path: text}`: the files a rollout of `item` finds in its workspace at the start.
StartingFiles = Callable[[Any, Mapping[str, Any]], Mapping[str, str]]
B = TypeVar("B", bound=DatasetBuilder)

_MISSING = object()
# A function name as the OpenAI and Foundry APIs take it (ASCII only: `str.isalnum` takes "é" and "²").
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _allows_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    origin = get_origin(annotation)
    if origin is Annotated:
        return _allows_none(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return any(_allows_none(arg) for arg in get_args(annotation))
    if origin is typing.Literal:
        return None in get_args(annotation)
    return False


def _nullable(annotation: Any) -> Any:
    """`T` → `T | None`, keeping `Annotated` metadata (descriptions, constraints) on the field."""
    if get_origin(annotation) is Annotated:
        inner, *metadata = get_args(annotation)
        return Annotated[(inner | None, *metadata)]
    return annotation | None


@dataclass(frozen=True)
class ToolSpec:
    """A registered tool: the function, its argument model, and what the model is told about it."""

    name: str
    fn: Callable[..., Any]
    description: str
    arguments: type[BaseModel]
    context_param: str | None
    defaults: Mapping[str, Any]
    mutates: bool
    is_async: bool
    # A synchronous tool declared `inline=True` runs on the event loop, not in a worker thread.
    inline: bool = False
    pack: str = ""
    base: Callable[[], Base] = field(default=lambda: EMPTY_BASE, compare=False)

    @cached_property
    def parameters(self) -> dict[str, Any]:
        """The strict-mode JSON schema of the arguments (all properties required, no extras)."""
        function = openai.pydantic_function_tool(self.arguments, name=self.name, description=self.description)
        params: dict[str, Any] = dict(function["function"].get("parameters") or {})
        params.pop("title", None)
        return params

    def function_tool(self) -> dict[str, Any]:
        """The chat-completions `tools` entry a dataset line carries."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
                "strict": True,
            },
        }

    def bind(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """Validate raw arguments into keyword arguments; nulls for defaulted parameters take the default."""
        model = self.arguments.model_validate(raw if type(raw) is dict else dict(raw))
        values = dict(model.__dict__)  # the fields, validated (the model forbids extra keys)
        for name, default in self.defaults.items():
            if values.get(name) is None:
                values[name] = default
        return values


def describe_validation_error(error: ValidationError) -> str:
    """A pydantic error in words a model can act on: `field: what is wrong`."""
    parts = []
    for item in error.errors(include_url=False):
        location = ".".join(str(p) for p in item["loc"]) or "arguments"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unexpected field (not in the tool's parameters)"
        elif item["type"] == "missing":
            message = "required field is missing"
        else:
            given = item.get("input")
            if given is not None and not isinstance(given, (dict, list)):
                message = f"{message} (got {given!r})"
        parts.append(f"{location}: {message}")
    return "; ".join(parts)


def build_spec(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    mutates: bool = False,
    inline: bool = False,
) -> ToolSpec:
    tool_name = name or fn.__name__
    if inline and inspect.iscoroutinefunction(fn):
        raise ToolDefinitionError(f"tool {tool_name!r}: inline=True is for synchronous functions")
    if not TOOL_NAME.fullmatch(tool_name):
        raise ToolDefinitionError(f"tool name {tool_name!r} must be 1-64 letters, digits, '_' or '-'")
    doc = description if description is not None else inspect.getdoc(fn)
    if not doc:
        raise ToolDefinitionError(f"tool {tool_name!r} needs a docstring or description: the model reads it")
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:  # unresolvable forward references
        raise ToolDefinitionError(f"tool {tool_name!r}: cannot resolve its type hints: {exc}") from exc

    fields, defaults, context_param = _parameters(tool_name, fn, hints)
    model_name = "".join(part.capitalize() for part in tool_name.replace("-", "_").split("_")) + "Arguments"
    try:
        model = create_model(model_name, __config__=ConfigDict(extra="forbid"), **fields)
        spec = ToolSpec(
            name=tool_name,
            fn=fn,
            description=doc,
            arguments=model,
            context_param=context_param,
            defaults=defaults,
            mutates=mutates,
            is_async=inspect.iscoroutinefunction(fn),
            inline=inline,
        )
        _ = spec.parameters  # build the schema now: unsupported types fail at definition
    except (PydanticSchemaGenerationError, PydanticInvalidForJsonSchema, PydanticUserError, TypeError) as exc:
        raise ToolDefinitionError(f"tool {tool_name!r}: unsupported parameter type: {exc}") from exc
    return spec


def _parameters(
    tool_name: str, fn: Callable[..., Any], hints: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """The arguments model's fields, the defaults the tool applies itself, and its ToolContext parameter.

    A parameter with a default is optional in the model (None there) and keeps its real default in
    `defaults`; one whose type does not allow None is made nullable.
    """
    fields: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    context_param: str | None = None
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise ToolDefinitionError(
                f"tool {tool_name!r}: parameter {param.name!r} must be a named parameter"
            )
        annotation = hints.get(param.name, _MISSING)
        if annotation is _MISSING:
            raise ToolDefinitionError(f"tool {tool_name!r}: parameter {param.name!r} has no type annotation")
        if annotation is ToolContext:
            if context_param is not None:
                raise ToolDefinitionError(f"tool {tool_name!r}: only one ToolContext parameter is allowed")
            context_param = param.name
            continue
        if param.default is inspect.Parameter.empty:
            fields[param.name] = (annotation, ...)
        else:
            if not _allows_none(annotation):
                annotation = _nullable(annotation)
                defaults[param.name] = param.default
            elif param.default is not None:
                defaults[param.name] = param.default
            fields[param.name] = (annotation, None)
    return fields, defaults, context_param


class Pack:
    """A named group of tools (and graders) sharing one base state, e.g. the retail environment.

    `settings` is the pack's own settings model (a `PackSettings` reading `SPARRING_<PACK>_*`);
    `lifespan(start)` is an async context manager run on the app's event loop when an app that serves
    the pack starts: it yields the pack's resources (a sandbox, a client, located data), which tools
    reach as `ctx.resource(T)` and state checks as `view.resource(T)`, and releases them when the app
    stops. It raises an exception with a clear message to refuse to start. `base(resources)` then
    loads the records every rollout starts from (in a thread, once per start).

    A `Pack` is a declaration; `started(resources, base)` is the copy one app serves (app/packs.py).
    """

    def __init__(
        self,
        name: str,
        *,
        description: str = "",
        base: BaseLoader | None = None,
        settings: type[PackSettings] = PackSettings,
        lifespan: PackLifespan | None = None,
    ) -> None:
        check_settings_model(name, settings)
        self.name = name
        self.description = description
        self.load_base: BaseLoader = base or (lambda resources: EMPTY_BASE)
        # Loaded when an app starts the pack, and shared by every rollout of that app.
        self._base: Base | None = None if base is not None else EMPTY_BASE
        self.resources: object = None  # what the lifespan yielded, on a started copy
        self._tools: dict[str, ToolSpec] = {}
        self.state_checks: dict[str, StateCheck] = {}
        self.settings_model = settings
        self.lifespan: PackLifespan = lifespan or no_resources
        self.dataset_builder: DatasetBuilder | None = None
        # Tools the simulated user calls (a customer's phone), served at /user-tools/<name>: never
        # offered to the agent (not in `tools`, job configs, datasets, MCP or the episode protocols).
        self._user_tools: dict[str, ToolSpec] = {}
        self.scenario_loader: ScenarioLoader | None = None
        self.starting_files_of: StartingFiles | None = None

    def scenario(self, fn: ScenarioLoader) -> ScenarioLoader:
        """Register `fn(resources, item) -> scenario`: the user scenario of a dataset row, for a simulator
        (a `user_simulator` as a dataset line carries it); its pack offers `send_message_to_user` when
        SPARRING_USER_TOOL is set."""
        self.scenario_loader = fn
        return fn

    def user_tool(
        self,
        *,
        name: str | None = None,
        description: str | None = None,
        mutates: bool = False,
        inline: bool = False,
    ) -> Callable[[F], F]:
        """Register `fn` as a tool of the simulated user (`/user-tools/<name>`); returned unchanged.

        It shares the pack's rollout state with the agent's tools; the agent never sees it.
        """

        def register(func: F) -> F:
            spec = build_spec(func, name=name, description=description, mutates=mutates, inline=inline)
            if spec.name in self._user_tools:
                raise ToolDefinitionError(f"pack {self.name!r} already has a user tool named {spec.name!r}")
            self._user_tools[spec.name] = dataclasses.replace(spec, pack=self.name, base=self.base)
            return func

        return register

    @property
    def user_tools(self) -> dict[str, ToolSpec]:
        return dict(self._user_tools)

    def dataset(self, fn: B) -> B:
        """Register `fn(resources, split, out) -> lines written`: `sparring dataset build <pack> ...`.

        It runs while the pack is started (`resources` is what its lifespan yielded), writes the pack's
        Agent RFT dataset for a split as JSONL, and raises ValueError with a clear message for an
        unknown split or a line that would fail a job.
        """
        self.dataset_builder = fn
        return fn

    def starting_files(self, fn: StartingFiles) -> StartingFiles:
        """Register `fn(resources, item) -> {path: text}`: the files a rollout of the dataset row `item`
        starts with (a workspace pack's). The review diffs the files a rollout writes against them."""
        self.starting_files_of = fn
        return fn

    def files_at_start(self, item: Mapping[str, Any]) -> dict[str, str]:
        """The files a rollout of `item` starts with ({} for a pack without files, or before start)."""
        if self.starting_files_of is None:
            return {}
        return dict(self.starting_files_of(self.resources, item))

    @overload
    def tool(self, fn: F, /) -> F: ...

    @overload
    def tool(
        self,
        fn: None = None,
        /,
        *,
        name: str | None = None,
        description: str | None = None,
        mutates: bool = False,
        inline: bool = False,
    ) -> Callable[[F], F]: ...

    def tool(
        self,
        fn: F | None = None,
        /,
        *,
        name: str | None = None,
        description: str | None = None,
        mutates: bool = False,
        inline: bool = False,
    ) -> F | Callable[[F], F]:
        """Register `fn` as a tool and return it unchanged (usable bare or with arguments).

        A synchronous tool runs in a worker thread, so a slow or blocking one cannot stall the
        server; `inline=True` runs it on the event loop instead, which saves the thread hop (about
        0.15 ms of CPU a call): only for quick work on memory and the rollout state, never I/O.
        """

        def register(func: F) -> F:
            spec = build_spec(func, name=name, description=description, mutates=mutates, inline=inline)
            if spec.name in self._tools:
                raise ToolDefinitionError(f"pack {self.name!r} already has a tool named {spec.name!r}")
            self._tools[spec.name] = dataclasses.replace(spec, pack=self.name, base=self.base)
            return func

        if fn is not None:
            return register(fn)
        return register

    def state_check(self, name: str) -> Callable[[C], C]:
        """Register a check of the rollout's final state; it is served as the grader `name`."""

        def register(fn: C) -> C:
            if name in self.state_checks:
                raise ToolDefinitionError(f"pack {self.name!r} already has a state check named {name!r}")
            self.state_checks[name] = fn
            return fn

        return register

    @property
    def tools(self) -> dict[str, ToolSpec]:
        return dict(self._tools)

    def base(self) -> Base:
        """The records every rollout starts from (RuntimeError before an app started the pack)."""
        if self._base is None:
            raise RuntimeError(
                f"pack {self.name!r} has not started: its base is loaded when an app starts it "
                "(app.packs.start_pack)"
            )
        return self._base

    def started(self, resources: object, base: Base) -> Pack:
        """The copy of this pack an app serves: its tools and `base()` read `base`; `resources` is
        what its lifespan yielded."""
        served = copy.copy(self)
        served.resources = resources
        served._base = base
        served._tools = {
            name: dataclasses.replace(spec, base=served.base) for name, spec in self._tools.items()
        }
        served._user_tools = {
            name: dataclasses.replace(spec, base=served.base) for name, spec in self._user_tools.items()
        }
        served.state_checks = {
            name: _with_resources(check, resources) for name, check in self.state_checks.items()
        }
        return served


def _with_resources(check: StateCheck, resources: object) -> StateCheck:
    """`check`, given views that carry `resources` (async stays async: the grader awaits it on the loop)."""
    if inspect.iscoroutinefunction(check):

        async def bound_async(view: RolloutView) -> CheckResult:
            result: CheckResult = await check(dataclasses.replace(view, resources=resources))
            return result

        return bound_async

    def bound(view: RolloutView) -> Any:
        return check(dataclasses.replace(view, resources=resources))

    return bound
