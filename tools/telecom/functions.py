"""τ²-bench's telecom environment functions that are not tools: the tasks' initialization actions and
the grader's assertions, on both sides, by the names the tasks use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tools.telecom import carrier
from tools.telecom.rollout import Rollout

# --- the user's side ------------------------------------------------------------------------------


def _set_user_info(rollout: Rollout, name: str, phone_number: str) -> None:
    rollout.phone.surroundings.update(name=name, phone_number=phone_number)


def _set_user_location(rollout: Rollout, abroad: bool) -> None:
    rollout.phone.surroundings["is_abroad"] = abroad


def _turn(setting: str, on: bool, *, search: bool) -> Callable[[Rollout], None]:
    def turn(rollout: Rollout) -> None:
        rollout.phone.turn(setting, on, search=search)

    return turn


def _airplane(on: bool) -> Callable[[Rollout], None]:
    def turn(rollout: Rollout) -> None:
        if rollout.phone.toggle_airplane_mode() != on:
            rollout.phone.toggle_airplane_mode()

    return turn


def _turn_data_on(rollout: Rollout) -> None:
    rollout.phone.device["data_enabled"] = True  # the reference's turn_data_on: no network search


def _set_network_mode(rollout: Rollout, mode: str) -> None:
    rollout.phone.set_network_mode(mode)


def _remove_app_permission(rollout: Rollout, app_name: str, permission: str) -> None:
    rollout.phone.set_permission(app_name, permission, False)


def _unseat_sim(rollout: Rollout) -> None:
    rollout.phone.device["sim_card_missing"] = True
    rollout.phone.network_search()


def _lock_sim(rollout: Rollout, mode: str) -> None:
    if mode in ("pin", "puk"):
        rollout.phone.device["sim_card_status"] = f"locked_{mode}"
    rollout.phone.network_search()


def _set_wifi_calling(rollout: Rollout, enabled: bool, mms_over_wifi: bool | None = None) -> None:
    device = rollout.phone.device
    device["wifi_calling_enabled"] = enabled
    if mms_over_wifi is not None:
        device["wifi_calling_mms_over_wifi"] = mms_over_wifi


def _break_apn(rollout: Rollout) -> None:
    rollout.phone.device["active_apn_settings"]["apn_name"] = "broken"
    rollout.phone.network_search()


def _break_apn_mms(rollout: Rollout) -> None:
    rollout.phone.device["active_apn_settings"]["mmsc_url"] = None


def _break_vpn(rollout: Rollout) -> None:
    rollout.phone.connect_vpn()
    details = rollout.phone.device["vpn_details"]
    if details is not None:
        details["server_performance"] = "poor"
    rollout.phone.vpn_performance = "poor"  # the reference's shared VPN object is the one broken


def _assert_service_status(rollout: Rollout, expected_status: str) -> bool:
    return bool(rollout.phone.device["network_connection_status"] == expected_status)


def _assert_internet_speed(rollout: Rollout, expected_speed: float, expected_desc: str | None = None) -> bool:
    measured, label = rollout.phone.speed()
    measured = measured or 0.0
    if expected_desc is None:
        return measured >= expected_speed
    return measured >= expected_speed and label.lower() == expected_desc.lower()


def _assert_device(setting: str) -> Callable[..., bool]:
    def check(rollout: Rollout, expected_status: bool) -> bool:
        return bool(rollout.phone.device[setting] == expected_status)

    return check


USER_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "set_user_info": _set_user_info,
    "set_user_location": _set_user_location,
    "simulate_network_search": lambda rollout: rollout.phone.network_search(),
    "turn_airplane_mode_on": _airplane(True),
    "turn_airplane_mode_off": _airplane(False),
    "turn_data_on": _turn_data_on,
    "turn_data_off": _turn("data_enabled", False, search=True),
    "turn_roaming_on": _turn("roaming_enabled", True, search=True),
    "turn_roaming_off": _turn("roaming_enabled", False, search=True),
    "turn_data_saver_mode_on": _turn("data_saver_mode", True, search=False),
    "turn_data_saver_mode_off": _turn("data_saver_mode", False, search=False),
    "set_network_mode_preference": _set_network_mode,
    "remove_app_permission": _remove_app_permission,
    "unseat_sim_card": _unseat_sim,
    "lock_sim_card": _lock_sim,
    "set_wifi_calling": _set_wifi_calling,
    "break_apn_settings": _break_apn,
    "break_apn_mms_setting": _break_apn_mms,
    "break_vpn": _break_vpn,
    "assert_airplane_mode_status": _assert_device("airplane_mode"),
    "assert_mobile_roaming_status": _assert_device("roaming_enabled"),
    "assert_mobile_data_saver_mode_status": _assert_device("data_saver_mode"),
    "assert_service_status": _assert_service_status,
    "assert_mobile_data_status": lambda rollout, expected_status: (
        rollout.phone.mobile_data_working() == expected_status
    ),
    "assert_internet_speed": _assert_internet_speed,
    "assert_internet_not_excellent": lambda rollout: rollout.phone.speed()[1].lower() != "excellent",
    "assert_can_send_mms": lambda rollout, expected_status: rollout.phone.can_send_mms() == expected_status,
    "assert_mobile_data_usage_exceeded": lambda rollout, expected_status: (
        rollout.phone.surroundings["mobile_data_usage_exceeded"] == expected_status
    ),
}

# --- the carrier's side ---------------------------------------------------------------------------

ASSISTANT_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "set_data_usage": lambda rollout, **arguments: carrier.set_data_usage(rollout.state, **arguments),
    "enable_roaming": lambda rollout, **arguments: carrier.set_roaming(
        rollout.state, enabled=True, **arguments
    ),
    "disable_roaming": lambda rollout, **arguments: carrier.set_roaming(
        rollout.state, enabled=False, **arguments
    ),
    "suspend_line_for_overdue_bill": lambda rollout, **arguments: carrier.suspend_for_overdue_bill(
        rollout.state, **arguments
    ),
    "assert_data_refueling_amount": lambda rollout, **arguments: carrier.assert_data_refueling_amount(
        rollout.state, **arguments
    ),
    "assert_line_status": lambda rollout, **arguments: carrier.assert_line_status(rollout.state, **arguments),
    "assert_overdue_bill_exists": lambda rollout, **arguments: carrier.assert_overdue_bill_exists(
        rollout.state, **arguments
    ),
    "assert_no_overdue_bill": lambda rollout, **arguments: carrier.assert_no_overdue_bill(
        rollout.state, **arguments
    ),
}
