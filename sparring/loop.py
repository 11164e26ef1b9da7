"""The rollout loop: one rollout of one dataset line, run the way the Agent RFT training service runs it.

This is the one rollout loop of sparring. `sparring eval`, `sparring canary`, the remote rollout
server and `sparring.client` all drive rollouts through `run_rollout`; they differ only in the three
things they plug into it:

- a **policy** (`Policy`): given the transcript so far, produce the next model turn (text and/or
  function calls). `sparring.policies` has the OpenAI Responses and Chat Completions policies,
  `sparring.canaries` the scripted ones; anything with an async `next_turn(transcript)` works.
- a **tool caller** (`ToolCaller`): send one function call and return what the model reads.
  `sparring.http.HttpToolCaller` posts the platform's envelope to sparring's tool URLs with the
  platform's retry and discard semantics; the server's in-process caller (`app.remote.runner`) or a
  test can be dropped in.
- a **grade caller** (`GradeCaller`, optional): score the finished rollout from the platform's
  `{sample, item, trace_id}`. `sparring.http.HttpGrader` posts to a grading route.

Interface (stable):

    result = await run_rollout(policy, tools, line, grader=grader, limits=EpisodeLimits(), trace_id=None,
                               tracing=None)

`line` is a `DatasetLine` (`DatasetLine.from_json(obj)` for one JSONL line). The loop:

1. starts a transcript from the line's `messages` and `tools` under a fresh `trace_<uuid4 hex>`
   (or the given `trace_id`);
2. asks the policy for a turn; a turn without function calls is the final answer;
3. sends every call of a turn to the tool caller, the calls of one turn concurrently, and appends
   the outputs in the turn's order; a call that failed for good (a `tool_crash` or `infra_error`
   after the retries) **discards** the rollout: it is returned with `discarded` set and is not graded;
4. stops at `limits.max_turns` model turns or `limits.max_tool_calls` calls (calls past the budget are
   not sent), as the platform's episode limit does: the rollout is then graded on its last text;
5. builds the platform's grader `sample` from the final text and the last batch of calls (with a
   simulated user, also `ended_by`: how the conversation ended, which τ² graders read), and grades
   it when a grader is given (a grader that keeps failing also discards the rollout).

`RolloutResult` holds the trace id, the transcript (messages and every step with its tool results),
the final text, the sample, the score, why it ended, the discard reason, token usage and timings.
Nothing here does I/O by itself: every network exchange goes through the policy, the tool caller or
the grader. With `tracing` (`sparring.tracing.RolloutTracing`), the rollout is an OpenTelemetry
`invoke_agent` span and each model turn a `chat` span; the calls and the grade run in its context.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

from sparring.tracing import RolloutTracing, mark_failed, record_rollout, record_usage
from sparring.wire import JSON_DEPTH_MAX, FailureKind, nested_deeper_than, new_trace_id

if TYPE_CHECKING:
    from sparring.usersim import SimulatedUser, UserConversation, UserReply

USER_KEY = "user_simulator"
"""The key of a dataset line holding what a simulated user needs (sparring.usersim)."""

ITEM_EXCLUDED_KEYS = ("tools", USER_KEY)
"""The keys of a dataset line left out of the `item` the tools and grader receive (the schemas are
already in the request; the simulated user's scenario is no business of the tools; the messages
stay, as the platform sends them to graders)."""

EndReason = Literal[
    "answer",
    "max_turns",
    "max_tool_calls",
    "discarded",
    # With a simulated user (sparring.usersim): its stop tokens, and τ²'s step limit.
    "user_stop",
    "user_transfer",
    "user_out_of_scope",
    "max_steps",
    "too_many_errors",
]


@dataclass(frozen=True)
class DatasetLine:
    """One RFT dataset line: the conversation, the tool schemas (chat-completions form), and the item.

    `item` is the line without its `tools`: what every tool call carries as `item` and graders read as
    `item.<key>` (`messages` included, so review flags see what the prompt told the model).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    item: dict[str, Any]
    user: Any = None  # the line's `user_simulator`, when it has one

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> DatasetLine:
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("a dataset line needs a non-empty `messages` list")
        tools = obj.get("tools") or []
        if not isinstance(tools, list):
            raise ValueError("`tools` must be a list")
        item = {key: value for key, value in obj.items() if key not in ITEM_EXCLUDED_KEYS}
        return cls(messages=list(messages), tools=list(tools), item=item, user=obj.get(USER_KEY))


@dataclass(frozen=True)
class FunctionCall:
    """One function call of a model turn. `arguments` is the JSON text the model wrote."""

    call_id: str
    name: str
    arguments: str
    id: str | None = None


@dataclass
class Usage:
    """Tokens the model spent (summed over turns and rollouts)."""

    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def add(self, other: Usage) -> None:
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens


@dataclass(frozen=True)
class ModelTurn:
    """What the policy answered in one turn.

    `replay` holds provider items the policy wants sent back verbatim in later requests (e.g. the
    Responses API's reasoning items); a policy that does not need it leaves it empty.
    """

    text: str = ""
    calls: tuple[FunctionCall, ...] = ()
    usage: Usage = field(default_factory=Usage)
    replay: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one call: the output the model reads, or the failure that discards the rollout."""

    call: FunctionCall
    output: str | None
    status: int | None = None  # the last HTTP status; None in-process, after a network error, or unsent
    attempts: int = 1
    latency_s: float = 0.0
    failure: str | None = None  # set when the call failed for good: the rollout is discarded
    failure_kind: FailureKind | None = None  # what failed, with `failure`

    @property
    def is_error(self) -> bool:
        """A mistake shown to the model: an `Error:` output, or a 4xx body."""
        if self.output is None:
            return False
        return self.output.startswith("Error:") or (self.status is not None and 400 <= self.status < 500)


@dataclass(frozen=True)
class GradeOutcome:
    """What a grade caller got: the score, or why there is none after the retries."""

    score: float | None
    failure: str | None = None
    status: int | None = None  # the last HTTP status; None in-process or after a network error
    attempts: int = 1
    failure_kind: FailureKind | None = None  # what failed, with `failure`


@dataclass
class Step:
    """One model turn and the results of its calls, in the turn's order."""

    turn: ModelTurn
    results: list[ToolResult] = field(default_factory=list)
    # The ids the server got for the calls sent, in the turn's order (`sent_as`): the log's call ids.
    sent: list[str] = field(default_factory=list)
    reply: str | None = None  # the simulated user's answer to this turn's text, if one was given


@dataclass
class Transcript:
    """The rollout so far, provider-neutral: the line's messages, then one `Step` per model turn."""

    trace_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    item: dict[str, Any]
    steps: list[Step] = field(default_factory=list)
    user: UserConversation | None = None  # the simulated user's side, when one plays (sparring.usersim)

    @property
    def calls_made(self) -> int:
        return sum(len(step.results) for step in self.steps)

    def last_user_message(self) -> str:
        for message in reversed(self.messages):
            if message.get("role") == "user":
                return content_text(message.get("content"))
        return ""


class Policy(Protocol):
    """The next model turn from the transcript; raises `ModelFailure` when the model is unreachable."""

    async def next_turn(self, transcript: Transcript) -> ModelTurn: ...


class ToolCaller(Protocol):
    """Sends one function call of rollout `trace_id`; never raises for an HTTP or network failure."""

    async def call(self, call: FunctionCall, *, trace_id: str, item: Mapping[str, Any]) -> ToolResult: ...


class GradeCaller(Protocol):
    """Has a finished rollout scored; never raises for an HTTP or network failure."""

    async def grade(
        self, sample: Mapping[str, Any], item: Mapping[str, Any], trace_id: str
    ) -> GradeOutcome: ...


class ModelFailure(Exception):
    """The model endpoint failed (after its client's retries): the rollout is discarded, not graded.

    `brief` says what failed without quoting the endpoint (its error text may be an internal
    service's): what a server shows to whoever sent the rollout. The message is the whole story.
    """

    def __init__(self, message: str, *, brief: str | None = None) -> None:
        super().__init__(message)
        self.brief = brief if brief is not None else message


@dataclass(frozen=True)
class EpisodeLimits:
    """The episode limits: model turns and tool calls per rollout."""

    max_turns: int = 30
    max_tool_calls: int = 50


@dataclass
class RolloutResult:
    trace_id: str
    transcript: Transcript
    final_text: str
    ended_by: EndReason
    sample: dict[str, Any] | None = None
    grade: GradeOutcome | None = None
    discarded: str | None = None  # why the rollout was thrown away (never graded)
    usage: Usage = field(default_factory=Usage)
    duration_s: float = 0.0

    @property
    def score(self) -> float | None:
        return self.grade.score if self.grade is not None else None

    @property
    def tool_results(self) -> list[ToolResult]:
        return [result for step in self.transcript.steps for result in step.results]

    @property
    def tool_errors(self) -> int:
        return sum(1 for result in self.tool_results if result.is_error)


def function_of(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The function of a dataset tool: chat form `{"type": "function", "function": {...}}`, or flat."""
    inner = tool.get("function")
    return inner if isinstance(inner, Mapping) else tool


def content_text(content: Any) -> str:
    """The text of a message's `content`: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [part.get("text") for part in content if isinstance(part, dict)]
        return "".join(part for part in parts if isinstance(part, str))
    return ""


def _chat_tool_calls(calls: Sequence[FunctionCall]) -> list[dict[str, Any]]:
    return [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call in calls
    ]


def _not_json(text: str) -> Any:
    """NaN, Infinity: Python's json reads them, no JSON reader of the routes does (nor is it JSON)."""
    raise ValueError(f"{text} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # past the largest double: a number no JSON reader of the routes takes
        raise ValueError(f"{text[:40]} is past the largest double")
    return value


def _finite_int(text: str) -> int:
    value = int(text)
    _finite_float(text)
    return value


def _lone_surrogate(value: Any) -> bool:
    """Whether a string of `value` (a key included) holds a lone surrogate, which no UTF-8 encoder writes."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if not node.isascii():
                try:
                    node.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def routes_json(text: str) -> Any:
    """`text` read as JSON the way the tool and grade routes read it (orjson): a ValueError for what they
    refuse, NaN or Infinity, a number past the largest double, a lone surrogate (Python's json takes them
    all), or nesting deeper than JSON_DEPTH_MAX."""
    try:
        value = json.loads(text, parse_constant=_not_json, parse_float=_finite_float, parse_int=_finite_int)
    except RecursionError:  # a line repeating "[" nests past Python's recursion limit
        raise ValueError(f"nests more than {JSON_DEPTH_MAX} levels deep") from None
    if nested_deeper_than(value):
        raise ValueError(f"nests more than {JSON_DEPTH_MAX} levels deep")
    if _lone_surrogate(value):
        raise ValueError("holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not text")
    return value


def build_sample(
    final_text: str, last_batch: Sequence[FunctionCall], final_turn_calls: Sequence[FunctionCall] = ()
) -> dict[str, Any]:
    """The grader `sample` the platform sends: the answer as text, as JSON when it parses as the grade
    routes read JSON (no NaN or Infinity, no number past the largest double, no deeper nesting than
    they take), and the last calls.

    `output_tools` holds the last batch of calls the rollout made, in the chat completions shape (as
    the OpenAI grader docs show them, and as the service fills it); `choices[0].message` is the final
    turn, with those of its calls the loop executed when a limit ended the rollout mid-turn. Graders
    that need the whole trajectory read sparring's call log by `trace_id`.
    """
    tool_calls = _chat_tool_calls(final_turn_calls)
    output_json: Any = None
    stripped = final_text.strip()
    if stripped[:1] in ("{", "["):
        try:
            output_json = routes_json(stripped)
        except ValueError:  # what the grade routes would refuse: graded as its text
            output_json = None
    return {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": final_text, "tool_calls": tool_calls},
                "finish_reason": "tool_calls" if tool_calls else "stop",
            }
        ],
        "output_text": final_text,
        "output_json": output_json,
        "output_tools": _chat_tool_calls(last_batch),
        "output_reasoning_summary": None,
    }


async def run_rollout(
    policy: Policy,
    tools: ToolCaller,
    line: DatasetLine,
    *,
    grader: GradeCaller | None = None,
    limits: EpisodeLimits | None = None,
    trace_id: str | None = None,
    tracing: RolloutTracing | None = None,
    user: SimulatedUser | None = None,
) -> RolloutResult:
    """Run one rollout of `line` and grade it (see the module docstring for the whole contract).

    With `tracing`, the rollout is an `invoke_agent` span and each model turn a `chat` span under it
    (sparring.tracing); the tool calls and the grade run inside the rollout span's context. With `user`,
    a line that carries a user scenario is played against the simulated user (sparring.usersim).
    """
    trace_id = trace_id or new_trace_id()
    run = _Run(policy, tools, grader, limits or EpisodeLimits(), tracing, user)
    if tracing is None:
        return await _rollout(run, line, trace_id)
    with tracing.rollout(trace_id) as span:
        result = await _rollout(run, line, trace_id)
        record_rollout(
            span,
            ended_by=result.ended_by,
            tool_calls=len(result.tool_results),
            score=result.score,
            discarded=result.discarded,
        )
        record_usage(span, result.usage.input_tokens, result.usage.output_tokens)
        return result


@dataclass(frozen=True)
class _Run:
    """What one rollout runs with."""

    policy: Policy
    tools: ToolCaller
    grader: GradeCaller | None
    limits: EpisodeLimits
    tracing: RolloutTracing | None
    user: SimulatedUser | None


async def _rollout(run: _Run, line: DatasetLine, trace_id: str) -> RolloutResult:
    started = time.perf_counter()
    transcript = Transcript(
        trace_id=trace_id,
        messages=list(line.messages),
        tools=list(line.tools),
        item=dict(line.item),
    )
    usage = Usage()

    def finish(ended_by: EndReason, text: str, discarded: str | None = None) -> RolloutResult:
        if transcript.user is not None:
            usage.add(transcript.user.usage)
        return RolloutResult(
            trace_id=transcript.trace_id,
            transcript=transcript,
            final_text=text,
            ended_by=ended_by,
            discarded=discarded,
            usage=usage,
            duration_s=time.perf_counter() - started,
        )

    opened = await _open_conversation(run.user, line.user, transcript)
    if opened is not None:
        return finish(opened[0], "", opened[1])
    ended_by, text, last_calls, discarded = await _turns(run, transcript, usage)
    if discarded is not None:
        return finish("discarded", text, discarded)
    result = finish(ended_by, text)
    # The calls the loop executed, never all the turn asked for: a turn of 100,000 calls would make a
    # grade request no grader takes.
    final_calls = (
        [result.call for result in transcript.steps[-1].results]
        if transcript.steps and ended_by != "answer"
        else []
    )
    result.sample = build_sample(text, last_calls, final_calls)
    if transcript.user is not None:
        # τ² checks what the agent had to communicate in any of its messages, not only in its last.
        result.sample["output_text"] = "\n".join(_agent_texts(transcript))
        # How the conversation ended, for the grader: τ² rewards one cut short (max_steps,
        # too_many_errors) 0, whatever its database and messages.
        result.sample["ended_by"] = ended_by
    if run.grader is not None:
        result.grade = await run.grader.grade(result.sample, transcript.item, transcript.trace_id)
        if result.grade.score is None:
            result.discarded = f"grader_failed: {result.grade.failure}"
    result.duration_s = time.perf_counter() - started
    return result


def _agent_texts(transcript: Transcript) -> list[str]:
    """Every message the agent wrote in a conversation, in order (τ²'s greeting first)."""
    opening = [m for m in transcript.messages if m.get("role") == "assistant"]
    texts = [content_text(m.get("content")) for m in opening]
    return [text for text in (*texts, *(step.turn.text for step in transcript.steps)) if text]


async def _next_turn(policy: Policy, transcript: Transcript, tracing: RolloutTracing | None) -> ModelTurn:
    """The policy's next turn, as a `chat` span when the rollout is traced."""
    if tracing is None:
        return await policy.next_turn(transcript)
    with tracing.chat(transcript.trace_id) as span:
        try:
            turn = await policy.next_turn(transcript)
        except ModelFailure as exc:
            mark_failed(span, exc)
            raise
        record_usage(span, turn.usage.input_tokens, turn.usage.output_tokens)
        return turn


async def _open_conversation(
    user: SimulatedUser | None, scenario: Any, transcript: Transcript
) -> tuple[EndReason, str | None] | None:
    """With a simulated user and a line that has a scenario: the agent's opening (its prompt, τ²'s
    greeting, the user's first message) replaces the line's messages. Returns how the rollout ended
    when the user ended it at once or its model failed (then with the discard reason), else None."""
    if user is None:
        return None
    try:
        conversation = user.start(scenario, transcript.item, transcript.trace_id)
    except ValueError as exc:
        return "discarded", f"user_error: {exc}"
    if conversation is None:
        return None
    transcript.user = conversation
    try:
        transcript.messages, reply = await conversation.open(transcript.messages)
    except ModelFailure as exc:
        return "discarded", f"user_model_error: {exc}"
    return (reply.ended, None) if reply.ended is not None else None


async def _user_reply(conversation: UserConversation, step: Step) -> tuple[EndReason | None, str | None]:
    """The simulated user's answer to the agent's message of `step`: how it ended the episode (its stop
    tokens, τ²'s step limit), and the discard reason when its model failed."""
    conversation.count()
    if conversation.exhausted:
        return "max_steps", None
    try:
        reply: UserReply = await conversation.reply(step.turn.text)
    except ModelFailure as exc:
        return "discarded", f"user_model_error: {exc}"
    step.reply = reply.text  # also the message that ended it (the transcript shows its stop token)
    return reply.ended, None


def sent_as(calls: Sequence[FunctionCall], used: set[str]) -> list[FunctionCall]:
    """The calls as the server gets them: an id the rollout used already (a model server that numbers the
    calls of each answer from 0, say) gets a suffix, so the server never takes the call for a retry of
    another (`call_id already used`, or the earlier call's answer replayed and the call not applied)."""
    sent = []
    for call in calls:
        call_id, n = call.call_id, 0
        while call_id in used:
            n += 1
            call_id = f"{call.call_id}~{n}"
        used.add(call_id)
        sent.append(call if call_id == call.call_id else replace(call, call_id=call_id))
    return sent


async def _turns(
    run: _Run, transcript: Transcript, usage: Usage
) -> tuple[EndReason, str, tuple[FunctionCall, ...], str | None]:
    """The model's turns and their tool calls, within the limits, appended to `transcript`; with a
    simulated user, each turn without calls goes to the user, whose answer the next turn reads.

    Returns why the episode ended, the last turn's text, the last calls sent, and why the rollout is
    discarded (a model or tool failure), or None.
    """
    text = ""
    last_calls: tuple[FunctionCall, ...] = ()
    limits, conversation = run.limits, transcript.user
    for _ in range(limits.max_turns):
        try:
            turn = await _next_turn(run.policy, transcript, run.tracing)
        except ModelFailure as exc:
            return "discarded", text, last_calls, f"model_error: {exc}"
        usage.add(turn.usage)
        text = turn.text
        step = Step(turn=turn)
        transcript.steps.append(step)
        if not turn.calls:
            if conversation is None:
                return "answer", text, last_calls, None
            ended, discarded = await _user_reply(conversation, step)
            if ended is not None:
                return ended, text, last_calls, discarded
            continue
        budget = limits.max_tool_calls - transcript.calls_made
        to_send = turn.calls[: max(budget, 0)]
        trace_id, item = transcript.trace_id, transcript.item
        sent = sent_as(to_send, {call_id for done in transcript.steps for call_id in done.sent})
        step.sent = [call.call_id for call in sent]
        results = await asyncio.gather(*(run.tools.call(call, trace_id=trace_id, item=item) for call in sent))
        # The model reads each result under the id it wrote.
        step.results = [replace(result, call=call) for result, call in zip(results, to_send, strict=True)]
        if to_send:
            last_calls = to_send
        failed = next((r for r in step.results if r.failure is not None), None)
        if failed is not None:
            return "discarded", text, last_calls, f"tool_failed: {failed.call.name}: {failed.failure}"
        if len(to_send) < len(turn.calls):
            return "max_tool_calls", text, last_calls, None
        if conversation is not None:
            conversation.count()  # the agent's call and its results, as τ²'s orchestrator counts them
            ended = conversation.results_end(step.results)
            if ended is not None:
                return ended, text, last_calls, None
    return "max_turns", text, last_calls, None
