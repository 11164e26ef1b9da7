"""Every tool of both sides, on the phone and carrier of every task of the base split (after its
initialization), through the served tool functions: the same outputs and final state as τ²-bench's own
environment, error paths included."""

from __future__ import annotations

from typing import Any

import pytest

from app.sdk import RolloutState, ToolContext, ToolError
from app.sdk.state import Changes
from tests.telecom import corpus, reference
from tests.telecom.corpus import Call
from tools.telecom import pack
from tools.telecom.data import TelecomData
from tools.telecom.rollout import database

pytestmark = pytest.mark.slow


def _user(name: str, **arguments: Any) -> Call:
    return ("user", name, arguments)


def _agent(name: str, **arguments: Any) -> Call:
    return ("assistant", name, arguments)


PHONE_PROBE: list[Call] = [
    _user("check_status_bar"),
    _user("check_network_status"),
    _user("check_network_mode_preference"),
    _user("run_speed_test"),
    _user("can_send_mms"),
    _user("set_network_mode_preference", mode="5g_only"),
    _user("set_network_mode_preference", mode="3g_only"),
    _user("run_speed_test"),
    _user("toggle_airplane_mode"),
    _user("check_status_bar"),
    _user("toggle_wifi"),
    _user("toggle_airplane_mode"),
    _user("toggle_wifi"),
    _user("check_wifi_status"),
    _user("check_network_status"),
    _user("toggle_wifi"),
    _user("check_wifi_status"),
    _user("check_sim_status"),
    _user("reseat_sim_card"),
    _user("toggle_data"),
    _user("toggle_data"),
    _user("toggle_roaming"),
    _user("check_data_restriction_status"),
    _user("toggle_data_saver_mode"),
    _user("check_data_restriction_status"),
    _user("run_speed_test"),
    _user("set_network_mode_preference", mode="2g_only"),
    _user("run_speed_test"),
    _user("can_send_mms"),
    _user("set_network_mode_preference", mode="4g_only"),
    _user("check_apn_settings"),
    _user("set_apn_settings", apn_settings={"apn_name": "internet", "mmsc_url": None}),
    _user("set_apn_settings", apn_settings={"apn_name": "nope"}),
    _user("check_apn_settings"),
    _user("can_send_mms"),
    _user("reset_apn_settings"),
    _user("reboot_device"),
    _user("check_apn_settings"),
    _user("check_wifi_calling_status"),
    _user("toggle_wifi_calling"),
    _user("check_wifi_calling_status"),
    _user("check_vpn_status"),
    _user("connect_vpn"),
    _user("check_vpn_status"),
    _user("connect_vpn"),
    _user("run_speed_test"),
    _user("disconnect_vpn"),
    _user("disconnect_vpn"),
    _user("check_installed_apps"),
    _user("check_app_status", app_name="messaging"),
    _user("check_app_status", app_name="camera"),
    _user("check_app_permissions", app_name="browser"),
    _user("check_app_permissions", app_name="nope"),
    _user("grant_app_permission", app_name="messaging", permission="SMS"),
    _user("grant_app_permission", app_name="messaging", permission="camera"),
    _user("grant_app_permission", app_name="nope", permission="sms"),
    _user("can_send_mms"),
    _user("check_payment_request"),
    _user("make_payment"),
]

DETAIL_IDS = ("L1002", "D1001", "B1001", "C1003", "P1002", "X1", "L9")
CARRIER_PROBE: list[Call] = [
    _agent("get_customer_by_phone", phone_number="555-123-2002"),
    _agent("get_customer_by_phone", phone_number="555-000-0000"),
    _agent("get_customer_by_id", customer_id="C1002"),
    _agent("get_customer_by_id", customer_id="C9999"),
    _agent("get_customer_by_name", full_name="john smith", dob="1985-06-15"),
    _agent("get_customer_by_name", full_name="John Smith", dob="1900-01-01"),
    *(_agent("get_details_by_id", id=key) for key in DETAIL_IDS),
    _agent("suspend_line", customer_id="C1001", line_id="L1002", reason="travel"),
    _agent("suspend_line", customer_id="C1001", line_id="L1002", reason="again"),
    _agent("suspend_line", customer_id="C1001", line_id="L2001", reason="not theirs"),
    _user("check_network_status"),
    _agent("resume_line", customer_id="C1001", line_id="L1002"),
    _agent("resume_line", customer_id="C1001", line_id="L1002"),
    _agent("get_bills_for_customer", customer_id="C1001", limit=2),
    _agent("get_bills_for_customer", customer_id="C1001"),
    _agent("send_payment_request", customer_id="C1001", bill_id="B1002"),
    _agent("send_payment_request", customer_id="C1001", bill_id="B1003"),
    _user("check_payment_request"),
    _user("make_payment"),
    _user("check_payment_request"),
    _agent("get_details_by_id", id="B1002"),
    _agent("send_payment_request", customer_id="C1001", bill_id="B9999"),
    _agent("get_data_usage", customer_id="C1001", line_id="L1002"),
    _agent("enable_roaming", customer_id="C1001", line_id="L1002"),
    _agent("enable_roaming", customer_id="C1001", line_id="L1002"),
    _agent("disable_roaming", customer_id="C1001", line_id="L1002"),
    _agent("disable_roaming", customer_id="C1001", line_id="L1002"),
    _agent("refuel_data", customer_id="C1001", line_id="L1002", gb_amount=-1),
    _agent("refuel_data", customer_id="C1001", line_id="L1002", gb_amount=2.5),
    _agent("refuel_data", customer_id="C1001", line_id="L1002", gb_amount=1),
    _agent("get_data_usage", customer_id="C1001", line_id="L1002"),
    _agent("get_bills_for_customer", customer_id="C1001", limit=3),
    _agent("transfer_to_human_agents", summary="the customer asked for a person"),
    _user("run_speed_test"),
]


def replay(task_id: str, calls: list[Call]) -> tuple[list[str], Changes]:
    """The calls through the pack's own tool functions, each on the changes of the ones before."""
    base = database(corpus.DATA_DIR)
    changes: Changes = {}
    outputs = []
    for requestor, name, arguments in calls:
        spec = (pack.user_tools if requestor == "user" else pack.tools)[name]
        state = RolloutState(base, changes, writable=True)
        kwargs = spec.bind(arguments)
        kwargs[spec.context_param or "ctx"] = ToolContext(
            trace_id="probe",
            call_id=None,
            tool_name=name,
            item={"task_id": task_id},
            state=state,
            logger=None,  # type: ignore[arg-type]
            resources=TelecomData(corpus.DATA_DIR),
        )
        try:
            outputs.append(corpus.masked(str(spec.fn(**kwargs))))
        except ToolError as exc:
            outputs.append(f"Error: {exc.message}")
            continue
        for collection, records in state.writes.items():
            changes.setdefault(collection, {}).update(records)
    return outputs, changes


@pytest.mark.parametrize("probe", ["phone", "carrier"])
def test_every_tool_of_both_sides_answers_as_the_reference(probe: str) -> None:
    calls = PHONE_PROBE if probe == "phone" else CARRIER_PROBE
    tasks = corpus.split_task_ids("train") + corpus.split_task_ids("test")
    assert len(tasks) == 114
    for task_id in tasks:
        outputs, changes = replay(task_id, calls)
        theirs = reference.run(task_id, calls)
        for call, ours, expected in zip(calls, outputs, theirs.outputs, strict=True):
            assert ours == expected, (task_id, call)
        assert corpus.state_text(changes) == theirs.state, task_id


def test_the_tools_are_the_references_names_order_descriptions_and_parameters() -> None:
    env = reference.get_environment()
    for theirs, ours in ((env.get_tools(), pack.tools), (env.get_user_tools(), pack.user_tools)):
        assert [tool.name for tool in theirs] == list(ours)
        for tool in theirs:
            schema = tool.openai_schema["function"]
            spec = ours[tool.name]
            assert spec.description == schema["description"], tool.name
            assert list(spec.parameters["properties"]) == list(schema["parameters"]["properties"]), tool.name
            for name, described in schema["parameters"]["properties"].items():
                if "description" in described:
                    assert spec.parameters["properties"][name]["description"] == described["description"]
