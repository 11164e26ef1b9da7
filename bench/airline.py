"""The airline pack at 1,000 concurrent rollouts, served as users run it: memory per rollout, calls/s.

    python -m bench.airline                        # 1,000 rollouts, Postgres + Redis and embedded
    python -m bench.airline --rollouts 200 --backends pg   # a quicker look

The server is `sparring serve` with its defaults (one worker) and SPARRING_PACKS=airline (the data from
`sparring packs fetch airline`, found under .sparring/ or SPARRING_AIRLINE_DATA), on Postgres + Redis
(`pg`: a fresh database, Redis db 13 flushed) and on the embedded backend (`embedded`: SQLite file,
in-memory state). All rollouts start at once; each replays the gold calls of a train task in order
(user and reservation lookups, flight searches, bookings, flight, baggage and passenger changes,
cancellations, certificates), so the mix is the benchmark's own. The rest is `bench.retail`'s: the echo
baseline, the memory per rollout once every rollout has finished its task (`pg`: the bytes of the
rollouts' Redis keys and Redis `used_memory`; `embedded`: the server's resident memory), and every
rollout graded by `POST /grade/airline` afterwards: all must score 1.0, i.e. 1,000 concurrent rollouts
did not see each other's writes (each booking got τ²-bench's first new reservation id, HATHAT).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bench.retail import PackBench, main
from bench.run import ROOT
from tools.airline import data as airline_data
from tools.airline import pack
from tools.airline.tasks import get_task, gold_calls, split_task_ids


def data_dir() -> Path:
    """SPARRING_AIRLINE_DATA if set, else fetched once into .sparring/ (as `sparring packs fetch airline`)."""
    return Path(
        os.environ.get("SPARRING_AIRLINE_DATA")
        or airline_data.DATA.fetch(airline_data.DATA.cache_dir(ROOT / ".sparring"))
    )


def answer(data: Path, task_id: str) -> str:
    return "Done. " + " and ".join(get_task(data, task_id).evaluation_criteria.communicate_info)


AIRLINE = PackBench(
    pack="airline",
    data_dir=data_dir,
    train=lambda data: split_task_ids(data, "train"),
    plan=lambda data, task_id: gold_calls(get_task(data, task_id)),
    answer=answer,
    is_write=lambda name: pack.tools[name].mutates,
    warm=("get_flight_status", {"flight_number": "HAT001", "date": "2024-05-15"}),
    serve=True,
)


if __name__ == "__main__":
    sys.exit(main(spec=AIRLINE, description=__doc__))
