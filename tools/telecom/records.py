"""The telecom records: the carrier's database (plans, customers, lines, bills, devices) and the customer's
phone (its settings and its surroundings), shaped as τ²-bench's telecom data models."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Field names, their order, their types and their defaults follow τ²-bench's data models
# (`tau2/domains/telecom/data_model.py` and `user_data_model.py`) on purpose: the reference shows the
# model `json.dumps(record.model_dump(), default=str)`, so a record is kept here in exactly that form
# (dates as `2025-02-25`, datetimes as `2025-01-20 14:30:00`, enums as their values) and an output is
# the `json.dumps` of the kept record.

PLANS = "plans"
CUSTOMERS = "customers"
LINES = "lines"
BILLS = "bills"
DEVICES = "devices"
CARRIER = (PLANS, CUSTOMERS, LINES, BILLS, DEVICES)
PHONE = "phone"  # one record per rollout for each of DEVICE and SURROUNDINGS
DEVICE = "device"
SURROUNDINGS = "surroundings"
SETUP = "setup"  # the rollout's task, once its initialization actions were applied (TASK), and VPN
TASK = "task"
VPN = "vpn"  # how the VPN `connect_vpn` joins performs, once the rollout's `break_vpn` broke it
COLLECTIONS = (*CARRIER, PHONE)


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Address(_Record):
    street: str
    city: str
    state: str
    zip_code: str


class Plan(_Record):
    plan_id: str
    name: str
    data_limit_gb: float
    price_per_month: float
    data_refueling_price_per_gb: float


class Device(_Record):
    device_id: str
    device_type: Literal["phone", "router", "tablet", "watch", "other"]
    model: str
    imei: str | None = None
    is_esim_capable: bool
    activated: bool = False
    activation_date: datetime.datetime | None = None
    last_esim_transfer_date: datetime.datetime | None = None


LineStatus = Literal["Active", "Suspended", "Pending Activation", "Closed"]


class Line(_Record):
    line_id: str
    phone_number: str
    status: LineStatus = "Pending Activation"
    plan_id: str
    device_id: str | None = None
    data_used_gb: float = 0.0
    data_refueling_gb: float = 0.0
    roaming_enabled: bool = False
    contract_end_date: datetime.date | None = None
    last_plan_change_date: datetime.date | None = None
    last_sim_replacement_date: datetime.date | None = None
    suspension_start_date: datetime.date | None = None


class LineItem(_Record):
    description: str
    amount: float
    date: datetime.date
    item_type: str


BillStatus = Literal["Draft", "Issued", "Awaiting Payment", "Paid", "Overdue", "Disputed"]


class Bill(_Record):
    bill_id: str
    customer_id: str
    period_start: datetime.date
    period_end: datetime.date
    issue_date: datetime.date
    total_due: float
    due_date: datetime.date
    line_items: list[LineItem] = Field(default_factory=list)
    status: BillStatus = "Draft"


class PaymentMethod(_Record):
    method_type: Literal["Credit Card", "Debit Card", "PayPal"]
    account_number_last_4: str
    expiration_date: str


class Customer(_Record):
    customer_id: str
    full_name: str
    date_of_birth: str
    email: str
    phone_number: str
    address: Address
    account_status: Literal["Active", "Suspended", "Pending Verification", "Closed"] = "Pending Verification"
    payment_methods: list[PaymentMethod] = Field(default_factory=list)
    line_ids: list[str] = Field(default_factory=list)
    bill_ids: list[str] = Field(default_factory=list)
    # The reference's default is a date in a datetime field (not validated): kept as it dumps.
    created_at: datetime.datetime | datetime.date = datetime.date(2025, 1, 1)
    last_extension_date: datetime.date | None = None
    goodwill_credit_used_this_year: float = 0.0


_MODELS: dict[str, type[_Record]] = {
    PLANS: Plan,
    CUSTOMERS: Customer,
    LINES: Line,
    BILLS: Bill,
    DEVICES: Device,
}
_KEYS = {PLANS: "plan_id", CUSTOMERS: "customer_id", LINES: "line_id", BILLS: "bill_id", DEVICES: "device_id"}


def as_kept(model: BaseModel) -> dict[str, Any]:
    """A model in the form the reference shows it: its dump, through `json.dumps(..., default=str)`."""
    kept: dict[str, Any] = json.loads(json.dumps(model.model_dump(), default=str))
    return kept


def carrier_record(collection: str, record: Mapping[str, Any]) -> dict[str, Any]:
    return as_kept(_MODELS[collection].model_validate(record))


def carrier_database(raw: Mapping[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """db.toml as kept records by id, each collection in the file's order."""
    missing = [name for name in CARRIER if not isinstance(raw.get(name), list)]
    if missing:
        raise ValueError(f"db.toml lacks the collections {', '.join(missing)}")
    database: dict[str, dict[str, dict[str, Any]]] = {}
    for name in CARRIER:
        records = (carrier_record(name, entry) for entry in raw[name])
        database[name] = {record[_KEYS[name]]: record for record in records}
    return database


# --- the phone ----------------------------------------------------------------------------------------


class APNName(StrEnum):
    """The reference's `APNNames`: an enum, not a literal, so that a wrong name is its `type=enum` error."""

    INTERNET = "internet"
    BROKEN = "broken"


class APNSettings(_Record):
    apn_name: APNName = APNName.INTERNET
    reset_at_reboot: bool = False
    mms_apn: str | None = "mms"
    mmsc_url: str | None = "http://mms.carrier.com/mms/wapenc"
    mms_proxy: str | None = None
    mms_port: int | None = None


class VpnDetails(_Record):
    server_address: str | None = None
    protocol: str | None = None
    server_performance: Literal["unknown", "poor", "fair", "good", "excellent"] = "unknown"


class AppPermissions(_Record):
    sms: bool = False
    storage: bool = False
    phone: bool = False
    network: bool = False


class AppStatus(_Record):
    app_name: str
    permissions: AppPermissions = Field(default_factory=AppPermissions)


def _default_apps() -> dict[str, AppStatus]:
    return {
        "messaging": AppStatus(
            app_name="messaging", permissions=AppPermissions(sms=True, storage=True, phone=True)
        ),
        "browser": AppStatus(app_name="browser", permissions=AppPermissions(network=True, storage=True)),
    }


Signal = Literal["none", "poor", "fair", "good", "excellent"]
Technology = Literal["none", "2G", "3G", "4G", "5G"]
ModePreference = Literal["4g_5g_preferred", "4g_only", "3g_only", "2g_only"]
MODE_PREFERENCES: tuple[str, ...] = ("4g_5g_preferred", "4g_only", "3g_only", "2g_only")


class Phone(_Record):
    sim_card_status: Literal["active", "missing", "locked_pin", "locked_puk"] = "active"
    sim_card_missing: bool = False
    airplane_mode: bool = False
    network_signal_strength: Signal = "good"
    network_technology_connected: Technology = "5G"
    network_connection_status: Literal["connected", "searching", "no_service", "emergency_only"] = "connected"
    battery_level: int = 80
    data_enabled: bool = True
    roaming_enabled: bool = False
    network_mode_preference: ModePreference = "4g_5g_preferred"
    active_apn_settings: APNSettings = Field(default_factory=APNSettings)
    wifi_enabled: bool = False
    wifi_connected: bool = False
    wifi_ssid: str | None = None
    wifi_signal_strength: Signal = "none"
    wifi_calling_enabled: bool = False
    wifi_calling_mms_over_wifi: bool = False
    data_saver_mode: bool = False
    vpn_enabled_setting: bool = False
    vpn_connected: bool = False
    vpn_details: VpnDetails | None = None
    app_statuses: dict[str, AppStatus] = Field(default_factory=_default_apps)


class PaymentRequest(_Record):
    bill_id: str
    amount_due: float
    paid: bool = False


def _default_signals() -> dict[Technology, Signal]:
    return {"2G": "poor", "3G": "fair", "4G": "good", "5G": "excellent"}


class Surroundings(_Record):
    name: str | None = None
    phone_number: str | None = None
    is_abroad: bool = False
    roaming_allowed: bool = False
    signal_strength: dict[Technology, Signal] = Field(default_factory=_default_signals)
    mobile_data_usage_exceeded: bool = False
    line_active: bool = True
    payment_request: PaymentRequest | None = None


def phone_records(raw: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """user_db.toml as the two kept records of the phone collection: the device and its surroundings."""
    return {
        DEVICE: as_kept(Phone.model_validate(raw.get(DEVICE, {}))),
        SURROUNDINGS: as_kept(Surroundings.model_validate(raw.get(SURROUNDINGS, {}))),
    }
