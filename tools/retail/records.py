"""The shapes of the store's records (users, orders, products), as τ²-bench's retail database defines them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

# Field names, their order and their defaults follow τ²-bench's data model on purpose: a record's
# `model_dump()` is what the reference shows the model and what its database hash is computed over,
# so the same dump here gives the same tool outputs and a database comparable field by field.

USERS = "users"
ORDERS = "orders"
PRODUCTS = "products"
COLLECTIONS = (PRODUCTS, USERS, ORDERS)

OrderStatus = Literal[
    "processed",
    "pending",
    "pending (item modified)",
    "delivered",
    "cancelled",
    "exchange requested",
    "return requested",
]
CancelReason = Literal["no longer needed", "ordered by mistake"]
CANCEL_REASONS: frozenset[str] = frozenset({"no longer needed", "ordered by mistake"})


class Variant(BaseModel):
    item_id: str
    options: dict[str, str]
    available: bool
    price: float


class Product(BaseModel):
    name: str
    product_id: str
    variants: dict[str, Variant]


class UserName(BaseModel):
    first_name: str
    last_name: str


class Address(BaseModel):
    address1: str
    address2: str
    city: str
    country: str
    state: str
    zip: str


class CreditCard(BaseModel):
    source: Literal["credit_card"]
    id: str
    brand: str
    last_four: str


class Paypal(BaseModel):
    source: Literal["paypal"]
    id: str


class GiftCard(BaseModel):
    source: Literal["gift_card"]
    id: str
    balance: float


PaymentMethod = Annotated[CreditCard | GiftCard | Paypal, Field(discriminator="source")]


class User(BaseModel):
    user_id: str
    name: UserName
    address: Address
    email: str
    payment_methods: dict[str, PaymentMethod]
    orders: list[str]


class Fulfillment(BaseModel):
    tracking_id: list[str]
    item_ids: list[str]


class OrderItem(BaseModel):
    name: str
    product_id: str
    item_id: str
    price: float
    options: dict[str, str]


class OrderPayment(BaseModel):
    transaction_type: Literal["payment", "refund"]
    amount: float
    payment_method_id: str


class Order(BaseModel):
    order_id: str
    user_id: str
    address: Address
    items: list[OrderItem]
    status: OrderStatus
    fulfillments: list[Fulfillment]
    payment_history: list[OrderPayment]
    cancel_reason: CancelReason | None = None
    exchange_items: list[str] | None = None
    exchange_new_items: list[str] | None = None
    exchange_payment_method_id: str | None = None
    exchange_price_difference: float | None = None
    return_items: list[str] | None = None
    return_payment_method_id: str | None = None


_MODELS: dict[str, type[BaseModel]] = {PRODUCTS: Product, USERS: User, ORDERS: Order}


def canonical_database(raw: Mapping[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """db.json as validated records in their canonical dump: optional fields present, numbers as floats.

    The reference compares databases after this same normalisation, so a record read from the file
    and the same record rewritten by a tool compare equal.
    """
    missing = [name for name in COLLECTIONS if not isinstance(raw.get(name), dict)]
    if missing:
        raise ValueError(f"db.json lacks the collections {', '.join(missing)}")
    return {
        name: {key: model.model_validate(record).model_dump() for key, record in raw[name].items()}
        for name, model in _MODELS.items()
    }


def canonical_record(collection: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """A record as the reference holds it: validated by its model and dumped again."""
    return _MODELS[collection].model_validate(record).model_dump()
