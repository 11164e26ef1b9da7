"""One telecom rollout: the carrier's records and the customer's phone, set up from the task, kept in sync.

Every call of either side runs as τ²-bench's environment runs it: the task's initialization actions
first (on the rollout's first call that carries `item.task_id`), then the call, then the sync of the
phone with the carrier (line active, roaming allowed, data limit exceeded, payment requests).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from app.sdk import Base, RolloutState, ToolContext, ToolError
from tools.telecom import carrier, data
from tools.telecom.phone import Handset
from tools.telecom.records import (
    DEVICE,
    PHONE,
    PLANS,
    SETUP,
    SURROUNDINGS,
    TASK,
    VPN,
    carrier_database,
    phone_records,
)


@lru_cache(maxsize=2)
def database(directory: Path) -> Base:
    """The carrier as shipped and the phone as τ²-bench starts it, once per data directory. Shared by
    every rollout: read it only."""
    base: dict[str, Any] = dict(carrier_database(data.read_toml(directory, "db.toml")))
    base[PHONE] = phone_records(data.read_toml(directory, "user_db.toml"))
    return base


@dataclass
class Rollout:
    """The state of one rollout as both sides' tools see it."""

    state: RolloutState
    phone: Handset

    @classmethod
    def open(cls, state: RolloutState) -> Rollout:
        phone = Handset(state.get(PHONE, DEVICE), state.get(PHONE, SURROUNDINGS))
        vpn = state.get(SETUP, VPN)
        if vpn is not None:
            phone.vpn_performance = vpn["server_performance"]
        return cls(state, phone)

    def close(self) -> None:
        """Put back the phone's records that changed."""
        for key, value in ((DEVICE, self.phone.device), (SURROUNDINGS, self.phone.surroundings)):
            if self.state.get(PHONE, key) != value:
                self.state.put(PHONE, key, value)
        if self.phone.vpn_performance != Handset.vpn_performance and self.state.get(SETUP, VPN) is None:
            self.state.put(SETUP, VPN, {"server_performance": self.phone.vpn_performance})

    def sync(self) -> None:
        """τ²-bench's `sync_tools`: what the carrier's records mean on the phone, and bills paid there."""
        around = self.phone.surroundings
        number = around["phone_number"]
        if number is None:
            return
        line = carrier.line_by_phone(self.state, number)
        around["line_active"] = line["status"] == "Active"
        around["roaming_allowed"] = bool(line["roaming_enabled"])
        plan = carrier.record(self.state, PLANS, line["plan_id"])
        limit = plan["data_limit_gb"] + line["data_refueling_gb"]
        around["mobile_data_usage_exceeded"] = line["data_used_gb"] >= limit
        request = around["payment_request"]
        if request is not None and request["paid"]:
            carrier.set_bill_status(self.state, request["bill_id"], "Paid")
            around["payment_request"] = None
        if around["payment_request"] is None:
            customer = carrier.customer_by_phone(self.state, number)
            bills = carrier.bills_awaiting_payment(self.state, customer)
            if bills:
                around["payment_request"] = {
                    "bill_id": bills[0]["bill_id"],
                    "amount_due": bills[0]["total_due"],
                    "paid": False,
                }


EnvFunction = Callable[..., Any]


def run_function(rollout: Rollout, env_type: str, name: str, arguments: Mapping[str, Any]) -> Any:
    """One of τ²-bench's environment functions (an initialization action or an assertion) and the sync
    after it, as its `run_env_function_call` does."""
    from tools.telecom.functions import ASSISTANT_FUNCTIONS, USER_FUNCTIONS

    functions = USER_FUNCTIONS if env_type == "user" else ASSISTANT_FUNCTIONS
    function = functions.get(name)
    if function is None:
        raise ToolError(f"Function {name} not found in {env_type} tools")
    result = function(rollout, **arguments)
    rollout.sync()
    return result


def set_up(rollout: Rollout, item: Mapping[str, Any], directory: Path) -> None:
    """Apply the task's initialization actions once per rollout (on its first call that names a task)."""
    if rollout.state.get(SETUP, TASK) is not None:
        return
    from tools.telecom.tasks import get_task

    task_id = item.get("task_id")
    if not isinstance(task_id, str):
        return
    try:
        task = get_task(directory, task_id)
    except KeyError as exc:
        raise ToolError(f"unknown telecom task {task_id!r} in the call's item") from exc
    for action in task.initialization_actions():
        run_function(rollout, action.env_type, action.func_name, action.arguments)
    rollout.state.put(SETUP, TASK, {"task_id": task_id})


def run_call(ctx: ToolContext, directory: Path, body: Callable[[Rollout], Any]) -> Any:
    """A tool call of either side: set up, run, sync, keep the phone's changes."""
    rollout = Rollout.open(ctx.state)
    set_up(rollout, ctx.item, directory)
    result = body(rollout)
    rollout.sync()
    rollout.close()
    return result
