"""The telecom task the simulated-user tests play, and the scripted customer's lines.

The phone has airplane mode and data saver on while abroad, and the line's roaming is off: the user
fixes the first two on its phone, the agent enables roaming at the carrier."""

from __future__ import annotations

from sparring.usersim import STOP

TASK = "[mobile_data_issue]airplane_mode_on|data_saver_mode_on|user_abroad_roaming_disabled_on[PERSONA:None]"
OPENING = "My mobile data doesn't work while I'm abroad."
ASK = "Please turn airplane mode off and turn data saver off, then tell me when it's done."
DONE = "Done, both are off now."
SOLVED = "I've checked your line and roaming is set. Is your data working now?"
FAREWELL = f"Yes, it works. Thank you! {STOP}"
