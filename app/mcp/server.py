"""The MCP server of the registry: tools/list from the registry, tools/call through ToolCallService.

One implementation for both transports (Streamable HTTP and stdio): the transport only says who is
calling (`Caller`: the rollout's trace id, the run label, the session that numbers the calls).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import mcp_types as types
from mcp.server import Server
from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError

from app.calls.envelope import ToolCallEnvelope
from app.calls.service import ToolCallService
from app.errors import INTERNAL_ERROR, ServiceUnavailable, SparringError, ToolCrashed, answer_to
from app.packs import Registry
from app.rollouts.identity import CALL_ID_MAX, fit
from sparring.wire import CALL_ID_META, json_bytes

log = logging.getLogger(__name__)

CHANNEL = "mcp"

# JSON-RPC error codes of a tools/call that got no answer. UNAVAILABLE is in the band the MCP spec
# leaves to implementations (-32000..-32019; the SDK itself uses -32000 and -32001 client-side).
UNAVAILABLE = -32010
CRASHED = types.INTERNAL_ERROR


class Unexpected(SparringError):
    """An error of sparring itself (neither a tool's crash nor an outage): the tool routes' 500."""

    status_code = 500
    code = INTERNAL_ERROR["error"]["code"]


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling: the rollout the call belongs to, its run label, the MCP session, and the pack
    whose tools it sees (None: the tools served at /tools/<name>)."""

    trace_id: str
    run: str
    session: str
    pack: str | None = None


def tool_list(registry: Registry, pack: str | None = None) -> list[types.Tool]:
    """The tools as MCP describes them: the registry's name, description and JSON schema, with
    `mutates` as the read-only / destructive hints. One pack's tools, else those at /tools/<name>."""
    tools = registry.tools if pack is None else registry.pack_tools[pack]
    return [
        types.Tool(
            name=spec.name,
            description=spec.description,
            input_schema=spec.parameters,
            annotations=types.ToolAnnotations(read_only_hint=not spec.mutates, destructive_hint=spec.mutates),
        )
        for spec in tools.values()
    ]


def mcp_call_id(session: str, request_id: str | int | None) -> str:
    """The call id of a session's JSON-RPC request: `mcp:` and the JSON array `[session, id]`.

    One id per (session, request id) pair: JSON marks where the session ends and whether the request
    id is a number or a string (`mcp_<session>_<id>` made `a_b`+`x` and `a`+`b_x`, or `1` and `"1"`,
    one call, and one got the other's answer), and `fit` keeps distinct ids distinct when it cuts
    them to the column. A numeric id beyond 64 bits (JSON-RPC sets no bound; orjson writes none) is
    written by `json`: no id orjson writes has its digits, so it stays a call of its own.
    """
    return fit("mcp:" + json_bytes([session, request_id]).decode(), CALL_ID_MAX)


def _call_id(caller: Caller, request_id: str | int | None, meta: types.RequestParamsMeta | None) -> str:
    """The call id that keys the ledger: the client's own (`_meta["sparring/call_id"]`), the tool
    routes' `call_id` in the rollout, else the session's JSON-RPC id. The JSON-RPC id numbers the calls
    of a session; with the session it keys the ledger, so a client resending a request gets the first
    answer, and sessions sharing one trace id (X-Sparring-Trace-Id) never take each other's answers."""
    given = (meta or {}).get(CALL_ID_META)
    if given is None:
        return mcp_call_id(caller.session, request_id)
    if not isinstance(given, str) or not given:
        raise MCPError(
            types.INVALID_PARAMS,
            f"_meta[{CALL_ID_META!r}] must be a non-empty string: the call's id, as `call_id` on the tool"
            " routes",
            data={"code": "invalid_call_id", "retryable": False},
        )
    return given


def _version() -> str:
    try:
        return metadata.version("sparring")
    except metadata.PackageNotFoundError:
        return "0"


class McpGateway:
    """Builds the SDK's low-level `Server` whose two handlers are the registry and the call service.

    `caller_of` reads the caller from the request context (HTTP: what `app.mcp.http` put in the ASGI
    scope; stdio: the process's one session). `on_outage` lets the HTTP transport answer 503.
    """

    def __init__(
        self,
        registry: Registry,
        service: ToolCallService,
        caller_of: Callable[[ServerRequestContext[Any, Any]], Caller],
        *,
        retry_after: int,
        on_failure: Callable[[ServerRequestContext[Any, Any], SparringError], None] | None = None,
    ) -> None:
        self.service = service
        self.retry_after = retry_after
        self.caller_of = caller_of
        self.on_failure = on_failure
        self.tools: dict[str | None, list[types.Tool]] = {None: tool_list(registry)}
        self.tools.update((pack, tool_list(registry, pack)) for pack in registry.pack_tools)
        self.server: Server[Any] = Server(
            "sparring",
            version=_version(),
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )
        # No OpenTelemetry span per message: nothing exports them, and each costs more than the call's
        # own bookkeeping on this path.
        self.server.middleware = []

    async def _list_tools(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self.tools[self.caller_of(ctx).pack])

    async def _call_tool(
        self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        caller = self.caller_of(ctx)
        envelope = ToolCallEnvelope(
            type="function_call",
            call_id=_call_id(caller, ctx.request_id, params.meta),
            name=params.name,
            arguments=params.arguments,
            trace_id=caller.trace_id,
        )
        try:
            result = await self.service.call(
                envelope, path_name=None, pack=caller.pack, run=caller.run, channel=CHANNEL
            )
        except Exception as exc:
            error = answer_to(exc, self.retry_after)
            if isinstance(error, ServiceUnavailable):
                # Not a tool result: the model must not see an outage as the tool's answer. The
                # client retries the request; the same id gets the answer once there is one.
                if self.on_failure is not None:
                    self.on_failure(ctx, error)
                raise MCPError(
                    UNAVAILABLE,
                    f"sparring is unavailable, retry in {error.retry_after} s: {error.message}",
                    data={"code": error.code, "retryable": True, "retry_after": error.retry_after},
                ) from exc
            if error is None:
                # A bug in sparring: as on the tool routes, a 500 whose text says nothing of the
                # exception (which may name hosts or data); the traceback is in the server log.
                log.exception("unexpected error answering an MCP tool call")
                error = Unexpected(INTERNAL_ERROR["error"]["message"])
            if isinstance(error, ToolCrashed | Unexpected):
                if self.on_failure is not None:
                    self.on_failure(ctx, error)
                raise MCPError(CRASHED, error.message, data={"code": error.code, "retryable": False}) from exc
            raise
        return types.CallToolResult(
            content=[types.TextContent(text=result.output.output)],
            # Every answer but `ok` is an `Error: ...` (model_error, call_id_reused).
            is_error=result.outcome != "ok",
        )
