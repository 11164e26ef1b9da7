"""The telecom tools: τ²-bench's 13 carrier tools for the agent, and the 30 tools of the customer's phone
that the simulated user calls (`Pack.user_tool`: never offered to the agent), on one rollout state.

Outputs are the reference environment's to the byte: a string as is, a record as the `json.dumps` of
its dump, a dict with its numbers written as strings (the reference's `to_json_str` quirk).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import anyio
from pydantic import Field, WithJsonSchema

from app.sdk import (
    Base,
    DataLocation,
    Pack,
    PackSettings,
    PackStart,
    ToolContext,
    ToolError,
    pack_settings_config,
)
from tools.telecom import carrier, data
from tools.telecom.data import TelecomData
from tools.telecom.records import BILLS, CUSTOMERS, LINES
from tools.telecom.rollout import Rollout, database, run_call


def load_base(resources: TelecomData) -> Base:
    """The carrier and the phone every rollout starts from; the tasks are parsed now too (14 MB of
    JSON), so a rollout's first call that names its task does not pay for it."""
    from tools.telecom.tasks import load_tasks

    load_tasks(resources.directory)
    return database(resources.directory)


class TelecomSettings(PackSettings):
    """The telecom pack's settings: `SPARRING_TELECOM_*`."""

    model_config = pack_settings_config("telecom")

    data: Path | None = Field(None, description="Unpacked telecom data directory (skips the download).")


@asynccontextmanager
async def lifespan(start: PackStart[TelecomSettings]) -> AsyncIterator[TelecomData]:
    """Use SPARRING_TELECOM_DATA, or the cache under SPARRING_HOME (fetched there if it is empty)."""
    location = DataLocation(data_dir=start.settings.data, home=start.home)
    yield TelecomData(await anyio.to_thread.run_sync(data.DATA.resolve, location))


pack = Pack(
    "telecom",
    description=(
        "τ²-bench's telecom tech-support environment (dual control): the agent works on the carrier's "
        "records while the simulated customer works on their phone."
    ),
    base=load_base,
    settings=TelecomSettings,
    lifespan=lifespan,
)


def _json(value: Any) -> str:
    return json.dumps(value, default=str)


def _run(ctx: ToolContext, body: Callable[[Rollout], str]) -> str:
    output: str = run_call(ctx, ctx.resource(TelecomData).directory, body)
    return output


CustomerId = Annotated[str, Field(description="ID of the customer who owns the line.")]
LineId = Annotated[str, Field(description="ID of the line.")]

# --- the agent's tools (in the reference's order) --------------------------------------------------


@pack.tool(mutates=True, inline=True)
def get_customer_by_phone(
    ctx: ToolContext, phone_number: Annotated[str, Field(description="The phone number to search for.")]
) -> str:
    """Finds a customer by their primary contact or line phone number."""
    return _run(ctx, lambda rollout: _json(carrier.customer_by_phone(rollout.state, phone_number)))


@pack.tool(mutates=True, inline=True)
def get_customer_by_id(
    ctx: ToolContext, customer_id: Annotated[str, Field(description="The unique identifier of the customer.")]
) -> str:
    """Retrieves a customer directly by their unique ID."""
    return _run(ctx, lambda rollout: _json(carrier.record(rollout.state, CUSTOMERS, customer_id)))


@pack.tool(mutates=True, inline=True)
def get_customer_by_name(
    ctx: ToolContext,
    full_name: Annotated[str, Field(description="The full name of the customer.")],
    dob: Annotated[str, Field(description="Date of birth for verification, in the format YYYY-MM-DD.")],
) -> str:
    """Searches for customers by name and DOB. May return multiple matches if names are similar,

    DOB helps disambiguate."""
    return _run(ctx, lambda rollout: _json(carrier.customers_by_name(rollout.state, full_name, dob)))


@pack.tool(mutates=True, inline=True)
def get_details_by_id(
    ctx: ToolContext, id: Annotated[str, Field(description="The ID of the object to retrieve.")]
) -> str:
    """Retrieves the details for a given ID.

    The ID must be a valid ID for a Customer, Line, Device, Bill, or Plan."""
    return _run(ctx, lambda rollout: _json(carrier.details(rollout.state, id)))


def _set_line_status(rollout: Rollout, customer_id: str, line_id: str, suspend: bool) -> str:
    state = rollout.state
    line = carrier.target_line(state, customer_id, line_id)
    if suspend:
        if line["status"] != "Active":
            raise ToolError("Line must be active to suspend")
        line.update(status="Suspended", suspension_start_date=carrier.TODAY.isoformat())
        message = "Line suspended successfully. $5/month holding fee will apply."
    else:
        if line["status"] not in ("Suspended", "Pending Activation"):
            raise ToolError("Line must be suspended to resume")
        line.update(status="Active", suspension_start_date=None)
        message = "Line resumed successfully"
    state.put(LINES, line_id, line)
    return _json({"message": message, "line": line})


@pack.tool(mutates=True, inline=True)
def suspend_line(
    ctx: ToolContext,
    customer_id: CustomerId,
    line_id: Annotated[str, Field(description="ID of the line to suspend.")],
    reason: Annotated[str, Field(description="Reason for suspension.")],
) -> str:
    """Suspends a specific line (max 6 months).

    Checks: Line status must be Active.
    Logic: Sets line status to Suspended, records suspension_start_date."""
    return _run(ctx, lambda rollout: _set_line_status(rollout, customer_id, line_id, True))


@pack.tool(mutates=True, inline=True)
def resume_line(
    ctx: ToolContext,
    customer_id: CustomerId,
    line_id: Annotated[str, Field(description="ID of the line to resume.")],
) -> str:
    """Resumes a suspended line.

    Checks: Line status must be Suspended or Pending Activation.
    Logic: Sets line status to Active, clears suspension_start_date."""
    return _run(ctx, lambda rollout: _set_line_status(rollout, customer_id, line_id, False))


def _bills(rollout: Rollout, customer_id: str, limit: int) -> str:
    customer = carrier.record(rollout.state, CUSTOMERS, customer_id)
    bills = [carrier.record(rollout.state, BILLS, key) for key in customer["bill_ids"]]
    bills.sort(key=lambda bill: bill["issue_date"], reverse=True)
    return _json(bills[:limit])


@pack.tool(mutates=True, inline=True)
def get_bills_for_customer(
    ctx: ToolContext,
    customer_id: Annotated[str, Field(description="ID of the customer.")],
    limit: Annotated[int, Field(description="Maximum number of bills to return.")] = 12,
) -> str:
    """Retrieves a list of the customer's bills, most recent first."""
    return _run(ctx, lambda rollout: _bills(rollout, customer_id, limit))


def _payment_request(rollout: Rollout, customer_id: str, bill_id: str) -> str:
    customer = carrier.record(rollout.state, CUSTOMERS, customer_id)
    if carrier.bills_awaiting_payment(rollout.state, customer):
        raise ToolError("A bill is already awaiting payment for this customer")
    if bill_id not in customer["bill_ids"]:
        raise ToolError(f"Bill {bill_id} not found for customer {customer_id}")
    carrier.set_bill_status(rollout.state, bill_id, "Awaiting Payment")
    return f"Payment request sent to the customer for bill {bill_id}"


@pack.tool(mutates=True, inline=True)
def send_payment_request(
    ctx: ToolContext,
    customer_id: Annotated[str, Field(description="ID of the customer who owns the bill.")],
    bill_id: Annotated[str, Field(description="ID of the bill to send payment request for.")],
) -> str:
    """Sends a payment request to the customer for a specific bill.

    Checks:
        - Customer exists
        - Bill exists and belongs to the customer
        - No other bills are already awaiting payment for this customer
    Logic: Sets bill status to AWAITING_PAYMENT and notifies customer.
    Warning: This method does not check if the bill is already PAID.
    Always check the bill status before calling this method."""
    return _run(ctx, lambda rollout: _payment_request(rollout, customer_id, bill_id))


@pack.tool(mutates=True, inline=True)
def get_data_usage(
    ctx: ToolContext,
    customer_id: CustomerId,
    line_id: Annotated[str, Field(description="ID of the line to check usage for.")],
) -> str:
    """Retrieves current billing cycle data usage for a line, including data

    refueling amount, data limit, and cycle end date."""
    return _run(ctx, lambda rollout: _json(carrier.data_usage(rollout.state, customer_id, line_id)))


@pack.tool(mutates=True, inline=True)
def enable_roaming(
    ctx: ToolContext,
    customer_id: CustomerId,
    line_id: Annotated[str, Field(description="ID of the line to enable roaming for.")],
) -> str:
    """Enables international roaming on a line."""
    return _run(ctx, lambda rollout: carrier.set_roaming(rollout.state, customer_id, line_id, True))


@pack.tool(mutates=True, inline=True)
def disable_roaming(
    ctx: ToolContext,
    customer_id: CustomerId,
    line_id: Annotated[str, Field(description="ID of the line to disable roaming for.")],
) -> str:
    """Disables international roaming on a line."""
    return _run(ctx, lambda rollout: carrier.set_roaming(rollout.state, customer_id, line_id, False))


@pack.tool(mutates=True, inline=True)
def transfer_to_human_agents(
    ctx: ToolContext, summary: Annotated[str, Field(description="A summary of the user's issue.")]
) -> str:
    """Transfer the user to a human agent, with a summary of the user's issue.

    Only transfer if
     -  the user explicitly asks for a human agent
     -  given the policy and the available tools, you cannot solve the user's issue."""
    return _run(ctx, lambda rollout: "Transfer successful")


@pack.tool(mutates=True, inline=True)
def refuel_data(
    ctx: ToolContext,
    customer_id: CustomerId,
    line_id: Annotated[str, Field(description="ID of the line to refuel data for.")],
    gb_amount: Annotated[
        float | int,  # a whole number stays one: the reference writes `2 GB` for 2 and `2.0 GB` for 2.0
        WithJsonSchema({"type": "number"}),
        Field(description="Amount of data to add in gigabytes."),
    ],
) -> str:
    """Refuels data for a specific line, adding to the customer's bill.

    Checks: Line status must be Active, Customer owns the line.
    Logic: Adds data to the line and charges customer based on the plan's refueling rate."""
    return _run(ctx, lambda rollout: _json(carrier.refuel(rollout.state, customer_id, line_id, gb_amount)))


from tools.telecom import device_tools as device_tools  # noqa: E402  (registers the phone's tools)
