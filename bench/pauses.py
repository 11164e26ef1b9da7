"""`run_python` by the time between calls: `python -m bench.pauses`.

One rollout calls `run_python` of a one-line script (`print(1)`) on the shipped server (`sparring serve`
with the code pack and its defaults, as `bench/warm.py` starts it), one call at a time, after each of
`--pauses` milliseconds (0: the next call as soon as the last is answered, as a rollout's parallel calls
run; 20: a model's short turn). What it shows: a run that comes before its slot's next run is prepared
(5 ms after an idle worker's last run) against one that finds it prepared, and the cost of an idle
moment on the machine. Results go to bench/results/pauses-<timestamp>.json (gitignored).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from bench.warm import Served, ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pauses", default="0,10,20", help="milliseconds between calls, comma-separated")
    parser.add_argument("--calls", type=int, default=100, help="calls after each pause")
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    pauses = [float(value) / 1000 for value in args.pauses.split(",")]
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as workdir:
        server = Served("warm", Path(workdir), {})
        try:
            server.wait_ready()
            trace = f"bench-pauses-{uuid.uuid4().hex[:8]}"
            server.call(trace, "write_file", {"path": "main.py", "content": "print(1)\n"})
            for _ in range(5):  # the page cache, the connection, the spare slot
                server.call(trace, "run_python", {"path": "main.py"})
            for pause in pauses:
                times = []
                for _ in range(args.calls):
                    time.sleep(pause)
                    started = time.perf_counter()
                    answer = server.call(trace, "run_python", {"path": "main.py"})
                    times.append(time.perf_counter() - started)
                    if not isinstance(answer, dict) or answer.get("stdout") != "1\n":
                        raise RuntimeError(f"run_python answered {answer!r}")
                summary = results[f"{pause * 1000:g}"] = ms(times)
                print(
                    f"pause {pause * 1000:4.0f} ms: run_python p50 {summary['p50_ms']:6.2f} ms"
                    f"  p99 {summary['p99_ms']:6.2f} ms"
                )
        finally:
            server.stop()
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"pauses-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps({"pauses_ms": results, "calls": args.calls}, indent=2))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
