"""The runner's small parts: item keys, job-config headers, tool URLs, canary scripts, the verdict."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import httpx2
import openai
import pytest

from sparring.canaries import all_canaries, gold_calls, placeholder, reference_text
from sparring.evaluate import DatasetError, FinishedRollout, Journal, line_key, read_dataset
from sparring.http import (
    Attempt,
    Endpoint,
    HttpAnswer,
    HttpGrader,
    HttpToolCaller,
    Retry,
    ToolEndpoints,
    fill_placeholders,
    retry_after,
    with_retries,
)
from sparring.loop import DatasetLine, FunctionCall, ModelFailure, Step, Transcript
from sparring.policies import failure_of, what_to_check
from sparring.report import CANARY_FIXES, canary_report
from sparring.session import TargetError, job_config_target
from sparring.wire import failure_kind_of_status


def test_a_line_is_keyed_as_the_server_keys_it() -> None:
    assert line_key({"task_id": "7", "messages": []}) == "task_id:7"
    hashed = line_key({"question": "what?", "reference_answer": [1, 2]})
    assert hashed.startswith("sha256:") and hashed == line_key(
        {"reference_answer": [1, 2], "question": "what?"}
    )


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (b'"score": NaN', "NaN is not a JSON number"),
        (b'"score": 1e400', "past the largest double"),
        (b'"name": "\\ud800"', "lone surrogate"),
        (b'"deep": ' + b"[" * 129 + b"]" * 129, "nests more than 128 levels"),
        (b'"deep": ' + b"[" * 100_000 + b"]" * 100_000, "nests more than 128 levels"),
        (b'"name": "caf\xe9"', "not UTF-8"),
    ],
)
def test_a_dataset_line_no_route_would_read_is_refused_naming_it(
    tmp_path: Path, bad: bytes, reason: str
) -> None:
    """What the routes' JSON reader refuses (every call and grade of the line would be a 400), or what
    no encoder writes back (a lone surrogate: the run stopped at its first call), names its line."""
    good = b'{"messages": [{"role": "user", "content": "hi"}], "id": 1}\n'
    dataset = tmp_path / "data.jsonl"
    dataset.write_bytes(good + b'{"messages": [{"role": "user", "content": "hi"}], ' + bad + b"}\n")
    with pytest.raises(DatasetError, match=f"data.jsonl:2: .*{reason}"):
        read_dataset(dataset)


def test_job_config_headers_are_filled_from_the_environment_keys() -> None:
    config = {
        "tools": [
            {
                "name": "a",
                "server_url": "https://h/tools/a",
                "headers": {"Authorization": "Bearer <SPARRING_TOOLS_KEY>"},
            },
            {
                "name": "b",
                "server_url": "https://h/tools",
                "headers": {"X-Functions-Key": "<SPARRING_TOOLS_KEY>"},
            },
        ]
    }
    endpoints = ToolEndpoints.from_job_config(config, {"SPARRING_TOOLS_KEY": "k1"})
    assert endpoints.resolve("a") is not None and endpoints.resolve("a").headers == {
        "Authorization": "Bearer k1"
    }  # type: ignore[union-attr]
    assert endpoints.resolve("b").url == "https://h/tools"  # type: ignore[union-attr]
    assert endpoints.resolve("c") is None
    with pytest.raises(ValueError, match="SPARRING_GRADER_KEY"):
        fill_placeholders({"Authorization": "Bearer <SPARRING_GRADER_KEY>"}, {"SPARRING_TOOLS_KEY": "k1"})
    # The message names the missing key, not another <...> of the value.
    with pytest.raises(ValueError, match="needs SPARRING_GRADER_KEY: set it"):
        fill_placeholders({"X-Auth": "<scheme> <SPARRING_GRADER_KEY>"}, {})


@pytest.mark.parametrize("headers", [["Authorization: Bearer <SPARRING_TOOLS_KEY>"], "Bearer x"])
def test_job_config_headers_that_are_not_an_object_are_a_clear_error(headers: object) -> None:
    config = {"tools": [{"name": "a", "server_url": "https://h/tools/a", "headers": headers}]}
    with pytest.raises(ValueError, match="tool 'a': `headers` must be an object"):
        ToolEndpoints.from_job_config(config, {"SPARRING_TOOLS_KEY": "k1"})
    with_grader = {
        "tools": [{"name": "a", "server_url": "https://h/tools/a"}],
        "grader": {"type": "endpoint", "url": "https://h/grade", "headers": headers},
    }
    with pytest.raises(TargetError, match="grader: `headers` must be an object"):
        job_config_target(with_grader, {})


def test_one_server_serves_every_tool_at_its_own_url() -> None:
    endpoints = ToolEndpoints.for_server("http://h:1/", {"Authorization": "Bearer k"})
    resolved = endpoints.resolve("get order/1")
    assert resolved is not None and resolved.url == "http://h:1/tools/get%20order%2F1"


def test_retry_waits_double_and_honour_retry_after_up_to_the_cap() -> None:
    retry = Retry(attempts=3, delay_s=0.5, max_delay_s=5.0)
    assert retry.wait(1, None) == 0.5 and retry.wait(2, None) == 1.0
    assert retry.wait(1, retry_after(HttpAnswer(503, {"Retry-After": "3"}, b""))) == 3.0
    assert retry.wait(1, retry_after(HttpAnswer(503, {"retry-after": "120"}, b""))) == 5.0
    assert retry_after(HttpAnswer(503, {"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}, b"")) is None


def test_canary_inputs_come_from_the_item() -> None:
    assert reference_text({"reference_answer": "JKT-9"}) == "JKT-9"
    assert reference_text({"reference_answer": {"total": 3}}) == '{"total": 3}'
    assert reference_text({"communicate_info": ["10.5", "blue"]}) == "10.5\nblue"
    assert reference_text({"communicate_info": []}) is None
    assert gold_calls(
        {"actions": [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": "{}"}, {}]}
    ) == [
        ("f", '{"x": 1}'),
        ("g", "{}"),
    ]
    assert gold_calls({"actions": "nope"}) == []
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string"},
            "n": {"type": ["integer", "null"]},
            "e": {"enum": ["b", "c"]},
            "o": {"type": "object", "properties": {"f": {"type": "boolean"}}},
            "a": {"anyOf": [{"type": "null"}, {"type": "array"}]},
        },
    }
    assert placeholder(schema) == {"s": "test", "n": 1, "e": "b", "o": {"f": False}, "a": []}


def test_a_placeholder_reads_boolean_subschemas_and_malformed_properties() -> None:
    """JSON Schema allows `true` and `false` as schemas (in `anyOf` too): the loop canary calls such a
    tool instead of stopping the canary run with an AttributeError; `properties` that are no object
    give an empty one."""
    schema = {
        "type": "object",
        "properties": {"a": {"anyOf": [True, {"type": "string"}]}, "b": {"anyOf": [{"type": "null"}, False]}},
    }
    assert placeholder(schema) == {"a": "test", "b": None}
    assert placeholder({"type": "object", "properties": ["a"]}) == {}


async def test_gold_plays_one_call_per_turn_then_answers_and_loop_repeats() -> None:
    line = DatasetLine.from_json(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "look",
                        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                    },
                }
            ],
            "actions": [{"name": "look", "arguments": {"q": "a"}}],
            "communicate_info": ["42"],
        }
    )
    canaries = all_canaries()
    transcript = Transcript("trace_x", line.messages, line.tools, line.item)
    first = await canaries["gold"].next_turn(transcript)
    assert first.calls == (FunctionCall(call_id="call_gold_0", name="look", arguments='{"q": "a"}'),)
    transcript.steps.append(Step(turn=first))
    assert (await canaries["gold"].next_turn(transcript)).text == "42"
    looped = await canaries["loop"].next_turn(transcript)
    assert [(c.name, c.arguments) for c in looped.calls] == [("look", '{"q": "test"}')]
    assert (await canaries["parrot"].next_turn(transcript)).text == "hi"
    assert canaries["guess"].applies(line) and canaries["gold"].applies(line)
    bare = DatasetLine.from_json({"messages": [{"role": "user", "content": "hi"}]})
    assert (
        not canaries["guess"].applies(bare)
        and not canaries["gold"].applies(bare)
        and not canaries["loop"].applies(bare)
    )


def record(policy: str, item: str, score: float | None, discarded: str | None = None) -> FinishedRollout:
    return FinishedRollout(item, 0, policy, "trace_x", score, discarded, "answer", 0, 0, 0, 0, 0.0)


def test_the_journal_gives_back_records_whose_text_holds_a_unicode_line_break(tmp_path: Path) -> None:
    """JSON writes U+2028, U+2029 and U+0085 as they are: a record holding one is still one line."""
    journal = Journal(tmp_path / "run.jsonl")
    records = [
        record("model", "id:a\u2028b", 1.0),
        record("model", "id:c", None, "tool_failed: x\x85y: HTTP 503\u2029"),
        record("model", "id:d", 0.0),
    ]
    for each in records:
        journal.append(each)
    assert journal.load() == records


def test_a_record_appended_after_a_line_cut_by_a_crash_is_kept(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "run.jsonl")
    first, second = record("model", "id:a", 1.0), record("model", "id:b", 0.0)
    journal.append(first)
    with journal.path.open("a", encoding="utf-8") as handle:
        handle.write('{"item_key": "id:c", "sam')  # the process died mid-write
    journal.append(second)
    assert journal.load() == [first, second]


def test_the_verdict_fails_on_a_scoring_canary_or_a_weak_gold() -> None:
    records = [
        record("empty", "a", 0.0), record("empty", "b", 0.0),
        record("guess", "a", 1.0), record("guess", "b", 0.0),
        record("gold", "a", 1.0), record("gold", "b", 0.5), record("gold", "c", None, "tool_failed: x"),
    ]  # fmt: skip
    report = canary_report(
        records, threshold=0.2, gold_minimum=0.9, policies=["empty", "guess", "gold"], grader="exact"
    )
    rows = {row["policy"]: row for row in report["policies"]}
    assert rows["guess"]["items_above_half"] == ["a"] and rows["guess"]["share_above_half"] == 0.5
    assert rows["gold"]["discarded"] == 1 and rows["gold"]["mean"] == 0.75
    # The canary that got through names the grader that let it and a fix that stops it.
    assert rows["guess"]["let_through_by"] == "exact" and "grounded" in rows["guess"]["fix"]
    assert rows["empty"]["let_through_by"] is None and rows["empty"]["fix"] is None
    assert report["failures"] == [
        "guess averages 0.500 >= 0.2: the grader can be gamed (let through by exact); fix: "
        + CANARY_FIXES["guess"],
        "gold averages 0.750 < 0.9: the grader misses correct work",
    ]
    passing = canary_report(records[:2], threshold=0.2, gold_minimum=0.9, policies=["empty", "gold"])
    assert passing["failures"] == []


async def test_one_retry_rule_for_calls_and_grades() -> None:
    """A value ends the tries; `refused` is final; any other failure is tried again up to the budget."""
    retry = Retry(attempts=3, delay_s=0.0, max_delay_s=0.0)

    def script(*tries: Attempt[str]) -> Callable[[], Awaitable[Attempt[str]]]:
        queue = list(tries)

        async def attempt() -> Attempt[str]:
            return queue.pop(0)

        return attempt

    crash = Attempt[str](failure="boom", kind="tool_crash")
    down = Attempt[str](failure="down", kind="infra_error")
    refused = Attempt[str](failure="no such grader", kind="refused")

    answered = await with_retries(retry, script(down, crash, Attempt(value="ok")))
    assert answered.last.value == "ok" and answered.attempts == 3

    failed = await with_retries(retry, script(down, down, crash))
    assert failed.last.kind == "tool_crash" and failed.attempts == 3
    assert failed.failure == "boom after 3 attempts"

    final = await with_retries(retry, script(refused))
    assert final.last.kind == "refused" and final.attempts == 1
    assert final.failure == "no such grader after 1 attempt"


@pytest.mark.parametrize("score", [b"NaN", b"Infinity", b"-Infinity", b"1" + b"0" * 400])
async def test_a_score_that_is_not_a_finite_number_is_no_score(score: bytes) -> None:
    """An endpoint grader on Python's json module writes NaN for a 0/0: a grade without a score (tried
    again, then the rollout is discarded), never a reward the report and the export cannot write, nor
    (an integer past the largest double) a crash of the run."""
    body = b'{"score": ' + score + b"}"
    answers = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
    retry = Retry(attempts=2, delay_s=0.0, max_delay_s=0.0)
    async with httpx.AsyncClient(transport=answers) as client:
        outcome = await HttpGrader(client, Endpoint("http://grader/grade"), retry=retry).grade(
            {"output_text": "x"}, {}, "trace_not_finite"
        )
    assert outcome.score is None and outcome.attempts == 2 and outcome.failure_kind == "infra_error"


async def test_a_tool_answer_trickling_in_is_cut_at_the_calls_timeout() -> None:
    """httpx's timeout bounds each wait for a byte, not the call: a proxy sending a byte now and then
    held the call (and the rollout) past its timeout, which is the whole call's, as the platform's."""

    class Trickle(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            yield b'{"output": "'
            for _ in range(40):
                await asyncio.sleep(0.05)
                yield b"x"
            yield b'"}'

    answers = httpx.MockTransport(lambda request: httpx.Response(200, stream=Trickle()))
    async with httpx.AsyncClient(transport=answers) as client:
        caller = HttpToolCaller(
            client,
            ToolEndpoints.for_server("http://sparring", {}),
            retry=Retry(attempts=2, delay_s=0.0, max_delay_s=0.0),
            timeout_s=0.3,
        )
        started = time.perf_counter()
        result = await caller.call(FunctionCall("c1", "slow", "{}"), trace_id="trace_trickle", item={})
    assert time.perf_counter() - started < 1.5
    assert result.output is None and result.failure_kind == "infra_error" and result.attempts == 2


@pytest.mark.parametrize("status", [408, 429])
async def test_a_grade_answered_too_many_requests_or_too_slow_is_tried_again(status: int) -> None:
    """408 and 429 say "not now", not "never": the grade is tried again (as the platform retries any
    failed grade), not refused at once and the rollout discarded."""
    answers = iter(
        [httpx.Response(status, headers={"Retry-After": "0"}), httpx.Response(200, json={"score": 1})]
    )
    transport = httpx.MockTransport(lambda request: next(answers))
    async with httpx.AsyncClient(transport=transport) as client:
        outcome = await HttpGrader(
            client, Endpoint("http://grader/grade"), retry=Retry(attempts=3, delay_s=0.0, max_delay_s=0.0)
        ).grade({"output_text": "x"}, {}, "trace_busy")
    assert outcome.score == 1.0 and outcome.attempts == 2


def test_an_http_status_names_its_failure_kind() -> None:
    assert [failure_kind_of_status(s) for s in (500, 502, 503, 504, 401, 404)] == [
        "tool_crash",
        "infra_error",
        "infra_error",
        "infra_error",
        "refused",
        "refused",
    ]
    answer = HttpAnswer(503, {"Retry-After": "2"}, b"")
    assert Attempt[float].failed_answer(answer, "HTTP 503") == Attempt(
        failure="HTTP 503", kind="infra_error", status=503, retry_after_s=2.0
    )


@pytest.mark.parametrize("policy_class", ["chat", "responses"])
def test_sampling_parameters_go_with_every_request_and_never_replace_what_the_policy_sends(
    policy_class: str,
) -> None:
    from openai import AsyncOpenAI

    from sparring.policies import ChatPolicy, ResponsesPolicy

    make = ChatPolicy if policy_class == "chat" else ResponsesPolicy
    client = AsyncOpenAI(api_key="k", base_url="http://127.0.0.1:9/v1")
    # `client` and `model` are the policy's own arguments; as sampling keys they are the server's
    # business (a sampling server may take a `client` field), not a clash with the constructor.
    policy = make(client, "m", client="c", temperature=0.2)
    assert policy.client is client and policy.model == "m"
    assert policy.params == {"client": "c", "temperature": 0.2}
    for reserved in ("model", "messages", "input", "tools", "stream"):
        with pytest.raises(ValueError, match=reserved):
            make(client, "m", **{reserved: "x"})


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (401, "the model API key: set MY_KEY"),
        (403, "the model API key: set MY_KEY"),
        (
            404,
            "--api responses: the endpoint has no /responses (most local servers speak only chat: "
            "try --api chat)",
        ),
        (400, "--model (a name this endpoint serves)"),
        (429, "the rate limit or quota of the key in MY_KEY"),
        (502, "it fails with HTTP 502"),
    ],
)
def test_a_failed_model_turn_says_what_to_check_by_status(status: int, expected: str) -> None:
    request = httpx2.Request("POST", "http://127.0.0.1:9/v1/responses")
    error = openai.APIStatusError("refused", response=httpx2.Response(status, request=request), body=None)
    try:
        raise failure_of(error) from error
    except ModelFailure as failure:
        hint = what_to_check(failure, api="responses", base_url="http://127.0.0.1:9/v1", key_env="MY_KEY")
    assert expected in hint, hint
