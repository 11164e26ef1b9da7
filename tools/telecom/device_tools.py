"""The 30 tools of the customer's phone, for the simulated user (`/user-tools/<name>`), in the reference's
order; descriptions are the reference's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import Field

from app.sdk import ToolContext
from tools.telecom.data import TelecomData
from tools.telecom.phone import Handset
from tools.telecom.rollout import Rollout, run_call
from tools.telecom.tools import pack

user_tool = pack.user_tool(mutates=True, inline=True)


def _run(ctx: ToolContext, body: Callable[[Handset], str]) -> str:
    output: str = run_call(ctx, ctx.resource(TelecomData).directory, lambda rollout: body(rollout.phone))
    return output


def _toggled(phone: Handset, label: str, setting: str, *, search: bool) -> str:
    return phone.with_status_bar(f"{label} is now {'ON' if phone.toggle(setting, search=search) else 'OFF'}.")


@user_tool
def check_status_bar(ctx: ToolContext) -> str:
    """Shows what icons are currently visible in your phone's status bar (the area at the top of the screen). Displays network signal strength, mobile data status (enabled, disabled, data saver), Wi-Fi status, and battery level."""  # noqa: E501
    return _run(ctx, lambda phone: f"Status Bar: {phone.status_bar()}")


@user_tool
def check_network_status(ctx: ToolContext) -> str:
    """Checks your phone's connection status to cellular networks and Wi-Fi. Shows airplane mode status, signal strength, network type, whether mobile data is enabled, and whether data roaming is enabled."""  # noqa: E501
    return _run(ctx, lambda phone: phone.network_status())


@user_tool
def check_network_mode_preference(ctx: ToolContext) -> str:
    """Shows the current network mode preference."""
    return _run(ctx, lambda phone: f"Network Mode Preference: {phone.device['network_mode_preference']}")


@user_tool
def set_network_mode_preference(
    ctx: ToolContext,
    mode: Annotated[str, Field(description="One of 4g_5g_preferred, 4g_only, 3g_only, 2g_only.")],
) -> str:
    """Changes the type of cellular network your phone prefers to connect to (e.g., 5G, LTE/4G, 3G). Higher-speed networks (LTE/5G) provide faster data but may use more battery."""  # noqa: E501
    return _run(ctx, lambda phone: phone.set_network_mode(mode))


@user_tool
def run_speed_test(ctx: ToolContext) -> str:
    """Measures your current internet connection speed (download speed). Provides information about connection quality and what activities it can support."""  # noqa: E501
    return _run(ctx, lambda phone: phone.speed_test())


@user_tool
def toggle_airplane_mode(ctx: ToolContext) -> str:
    """Toggles Airplane Mode ON or OFF. When ON, it disconnects all wireless communications including cellular, Wi-Fi, and Bluetooth.

    Returns the new state of airplane_mode."""  # noqa: E501
    return _run(
        ctx,
        lambda phone: phone.with_status_bar(
            f"Airplane Mode is now {'ON' if phone.toggle_airplane_mode() else 'OFF'}."
        ),
    )


@user_tool
def check_sim_status(ctx: ToolContext) -> str:
    """Checks if your SIM card is working correctly and displays its current status. Shows if the SIM is active, missing, or locked with a PIN or PUK code."""  # noqa: E501
    return _run(ctx, lambda phone: phone.sim_text())


def _reseat(phone: Handset) -> str:
    phone.device["sim_card_missing"] = False
    phone.network_search()
    return phone.with_status_bar("SIM card re-seated successfully.")


@user_tool
def reseat_sim_card(ctx: ToolContext) -> str:
    """Simulates removing and reinserting your SIM card. This can help resolve recognition issues."""
    return _run(ctx, _reseat)


@user_tool
def toggle_data(ctx: ToolContext) -> str:
    """Toggles your phone's mobile data connection ON or OFF. Controls whether your phone can use cellular data for internet access when Wi-Fi is unavailable.

    Returns the new data connection status."""  # noqa: E501
    return _run(ctx, lambda phone: _toggled(phone, "Mobile Data", "data_enabled", search=True))


@user_tool
def toggle_roaming(ctx: ToolContext) -> str:
    """Toggles Data Roaming ON or OFF. When ON, your phone can use data networks in areas outside your carrier's coverage.

    Returns the new data roaming status."""  # noqa: E501
    return _run(ctx, lambda phone: _toggled(phone, "Data Roaming", "roaming_enabled", search=True))


@user_tool
def check_data_restriction_status(ctx: ToolContext) -> str:
    """Checks if your phone has any data-limiting features active. Shows if Data Saver mode is on."""
    return _run(
        ctx,
        lambda phone: (
            "Data Saver mode is ON (limits data usage)."
            if phone.device["data_saver_mode"]
            else "Data Saver mode is OFF."
        ),
    )


@user_tool
def toggle_data_saver_mode(ctx: ToolContext) -> str:
    """Toggles Data Saver mode ON or OFF. When ON, it reduces data usage, which may affect data speed.

    Returns the new data saver mode status."""
    return _run(ctx, lambda phone: _toggled(phone, "Data Saver Mode", "data_saver_mode", search=False))


@user_tool
def check_apn_settings(ctx: ToolContext) -> str:
    """Checks the technical APN settings your phone uses to connect to your carrier's mobile data network. Shows current APN name and MMSC URL for picture messaging."""  # noqa: E501
    return _run(ctx, lambda phone: phone.apn_text())


@user_tool
def set_apn_settings(
    ctx: ToolContext,
    apn_settings: Annotated[
        dict[str, Any], Field(description="The APN settings to set (fields of APNSettings).")
    ],
) -> str:
    """Sets the APN settings for the phone."""
    return _run(ctx, lambda phone: phone.set_apn(apn_settings))


def _reset_apn(phone: Handset) -> str:
    phone.device["active_apn_settings"]["reset_at_reboot"] = True
    phone.network_search()
    return phone.with_status_bar("APN settings will reset at reboot.")


@user_tool
def reset_apn_settings(ctx: ToolContext) -> str:
    """Resets your APN settings to the default settings."""
    return _run(ctx, _reset_apn)


@user_tool
def check_wifi_status(ctx: ToolContext) -> str:
    """Checks your Wi-Fi connection status. Shows if Wi-Fi is turned on, which network you're connected to (if any), and the signal strength."""  # noqa: E501
    return _run(ctx, lambda phone: phone.wifi_text())


def _toggle_wifi(phone: Handset) -> str:
    on = phone.toggle_wifi()
    if on is None:
        return phone.with_status_bar("Cannot change Wi-Fi settings while Airplane Mode is ON.")
    return phone.with_status_bar(f"Wi-Fi is now {'ON' if on else 'OFF'}.")


@user_tool
def toggle_wifi(ctx: ToolContext) -> str:
    """Toggles your phone's Wi-Fi radio ON or OFF. Controls whether your phone can discover and connect to wireless networks for internet access.

    Returns the new Wi-Fi status."""  # noqa: E501
    return _run(ctx, _toggle_wifi)


@user_tool
def check_wifi_calling_status(ctx: ToolContext) -> str:
    """Checks if Wi-Fi Calling is enabled on your device. This feature allows you to make and receive calls over a Wi-Fi network instead of using the cellular network."""  # noqa: E501
    return _run(
        ctx,
        lambda phone: (
            f"Wi-Fi Calling is currently turned {'ON' if phone.device['wifi_calling_enabled'] else 'OFF'}."
        ),
    )


@user_tool
def toggle_wifi_calling(ctx: ToolContext) -> str:
    """Toggles Wi-Fi Calling ON or OFF. This feature allows you to make and receive calls over Wi-Fi instead of the cellular network, which can help in areas with weak cellular signal.

    Returns the new Wi-Fi Calling status."""  # noqa: E501
    return _run(ctx, lambda phone: _toggled(phone, "Wi-Fi Calling", "wifi_calling_enabled", search=False))


@user_tool
def check_vpn_status(ctx: ToolContext) -> str:
    """Checks if you're using a VPN (Virtual Private Network) connection. Shows if a VPN is active, connected, and displays any available connection details."""  # noqa: E501
    return _run(ctx, lambda phone: phone.vpn_text())


def _connect_vpn(phone: Handset) -> str:
    if not phone.connect_vpn():
        return "VPN already connected."
    return phone.with_status_bar("VPN connected successfully.")


@user_tool
def connect_vpn(ctx: ToolContext) -> str:
    """Connects to your VPN (Virtual Private Network)."""
    return _run(ctx, _connect_vpn)


def _disconnect_vpn(phone: Handset) -> str:
    done = phone.disconnect_vpn()
    return phone.with_status_bar(
        "VPN disconnected successfully." if done else "No active VPN connection to disconnect."
    )


@user_tool
def disconnect_vpn(ctx: ToolContext) -> str:
    """Disconnects any active VPN (Virtual Private Network) connection. Stops routing your internet traffic through a VPN server, which might affect connection speed or access to content."""  # noqa: E501
    return _run(ctx, _disconnect_vpn)


@user_tool
def check_installed_apps(ctx: ToolContext) -> str:
    """Returns the name of all installed apps on the phone."""
    return _run(
        ctx,
        lambda phone: (
            f"The following apps are installed on the phone: {', '.join(phone.device['app_statuses'])}"
        ),
    )


AppName = str


@user_tool
def check_app_status(ctx: ToolContext, app_name: AppName) -> str:
    """Checks detailed information about a specific app. Shows its permissions and background data usage settings."""  # noqa: E501
    return _run(ctx, lambda phone: phone.app_status_text(app_name))


@user_tool
def check_app_permissions(ctx: ToolContext, app_name: AppName) -> str:
    """Checks what permissions a specific app currently has. Shows if the app has access to features like storage, camera, location, etc."""  # noqa: E501
    return _run(ctx, lambda phone: phone.app_permissions_text(app_name))


def _grant(phone: Handset, app_name: str, permission: str) -> str:
    success, message = phone.set_permission(app_name, permission, True)
    return phone.with_status_bar(("Success. " if success else "Error. ") + message)


@user_tool
def grant_app_permission(
    ctx: ToolContext,
    app_name: Annotated[str, Field(description="The name of the app to grant the permission to.")],
    permission: Annotated[str, Field(description="The permission to grant, should be lowercase.")],
) -> str:
    """Gives a specific permission to an app (like access to storage, camera, or location). Required for some app functions to work properly."""  # noqa: E501
    return _run(ctx, lambda phone: _grant(phone, app_name, permission))


@user_tool
def can_send_mms(ctx: ToolContext) -> str:
    """Checks if the default messaging app can send MMS messages."""
    return _run(
        ctx,
        lambda phone: (
            "Your messaging app can send MMS messages."
            if phone.can_send_mms()
            else "Your messaging app cannot send MMS messages."
        ),
    )


@user_tool
def reboot_device(ctx: ToolContext) -> str:
    """Restarts your phone completely. This can help resolve many temporary software glitches by refreshing all running services and connections."""  # noqa: E501
    return _run(ctx, lambda phone: phone.with_status_bar(phone.reboot()))


@user_tool
def check_payment_request(ctx: ToolContext) -> str:
    """Checks if the agent has sent you a payment request."""
    return _run(ctx, lambda phone: phone.payment_request_text())


@user_tool
def make_payment(ctx: ToolContext) -> str:
    """Makes a payment for the bill that the agent has sent you."""
    return _run(ctx, lambda phone: phone.make_payment())


__all__ = ["Rollout"]
