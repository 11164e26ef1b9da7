"""The telecom pack at 1,000 concurrent rollouts, served as users run it: memory per rollout, calls/s.

    python -m bench.telecom                        # 1,000 rollouts, Postgres + Redis and embedded
    python -m bench.telecom --rollouts 200 --backends pg   # a quicker look

The server is `sparring serve` with its defaults (one worker) and SPARRING_PACKS=telecom (the data from
`sparring packs fetch telecom`, found under .sparring/ or SPARRING_TELECOM_DATA), on Postgres + Redis and
on the embedded backend. All rollouts start at once; each is a train task of τ²-bench's base split: its
calls carry the task (`item.task_id`), so the first one sets the rollout up (the phone broken as the task
says, the carrier's records changed), and then replays the task's gold actions of both sides in order —
the agent's at `/tools/<name>` (roaming, refuels, payment requests) and the customer's at
`/user-tools/<name>` (airplane mode, SIM, APN, permissions, VPN, payments). The rest is `bench.retail`'s:
the echo baseline, the memory per rollout once every rollout has finished (Redis keys and `used_memory`;
the embedded server's resident memory), and every rollout graded by `POST /grade/telecom`: all must score
1.0, i.e. 1,000 concurrent rollouts each fixed their own phone and no other.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bench.retail import PackBench, Plan, main
from bench.run import ROOT
from tools.telecom import data as telecom_data
from tools.telecom.tasks import get_task, split_task_ids

# The calls that change a phone or the carrier's records (every telecom call takes the rollout's lock).
WRITES = ("suspend", "resume", "send_payment", "enable", "disable", "refuel", "toggle", "set_", "reset")
WRITES_TOO = ("reboot", "reseat", "grant", "connect", "disconnect", "make_payment")


def data_dir() -> Path:
    """SPARRING_TELECOM_DATA if set, else fetched once into .sparring/ (as `sparring packs fetch telecom`)."""
    return Path(
        os.environ.get("SPARRING_TELECOM_DATA")
        or telecom_data.DATA.fetch(telecom_data.DATA.cache_dir(ROOT / ".sparring"))
    )


def plan(data: Path, task_id: str) -> Plan:
    """The task's gold actions of both sides; a task whose fix is no action reads the customer once."""
    actions = get_task(data, task_id).evaluation_criteria.actions
    calls = [
        (f"user-tools/{action.name}" if action.requestor == "user" else action.name, dict(action.arguments))
        for action in actions
    ]
    return calls or [("user-tools/check_status_bar", {})]


def is_write(name: str) -> bool:
    return name.rpartition("/")[2].startswith(WRITES + WRITES_TOO)


TELECOM = PackBench(
    pack="telecom",
    data_dir=data_dir,
    train=lambda data: split_task_ids(data, "train"),
    plan=plan,
    answer=lambda data, task_id: "Done.",
    is_write=is_write,
    warm=("get_customer_by_id", {"customer_id": "C1001"}),
    serve=True,
    task_items=True,
)


if __name__ == "__main__":
    sys.exit(main(spec=TELECOM, description=__doc__))
