"""Summarize a py-spy collapsed-stack profile (`--profile-format raw`): where the server's time goes.

    python -m bench.profile_summary bench/results/<stamp>-full-pg.collapsed.txt [--top 40] [--group]

Prints the functions with the most samples on their own (self) and anywhere on the stack
(inclusive), as a share of all samples. `--group` instead buckets inclusive time into the areas of
a tool call (auth, envelope, ledger, state, log writer, ...) by the first matching frame.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")

# Inclusive buckets, first match wins (checked from the leaf upwards, so the innermost area counts).
GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("call log writer (SQLAlchemy + driver)", ("app/calls/log_writer.py",)),
    ("redis client", ("redis/",)),
    ("sqlalchemy / asyncpg / aiosqlite", ("sqlalchemy/", "asyncpg/", "aiosqlite/")),
    ("prometheus metrics", ("prometheus_client/",)),
    ("rollout store (sparring code)", ("app/rollouts/",)),
    ("tool SDK: bind, state, context", ("app/sdk/",)),
    ("logging", ("logging/",)),
    ("pydantic", ("pydantic/", "pydantic_core/")),
    ("call service (sparring code)", ("app/calls/service.py",)),
    ("auth", ("app/auth.py",)),
    ("routes / envelope", ("app/calls/routes.py", "app/calls/envelope.py", "app/errors.py")),
    ("middleware", ("app/middleware.py",)),
    ("fastapi / starlette", ("fastapi/", "starlette/")),
    ("uvicorn / http parsing", ("uvicorn/", "httptools/")),
    ("asyncio / uvloop", ("asyncio/", "uvloop/")),
]


def parse(path: Path) -> list[tuple[list[tuple[str, str]], int]]:
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = []
        for raw in stack.split(";"):
            match = _FRAME.match(raw)
            frames.append((match["func"], match["file"]) if match else (raw, ""))
        stacks.append((frames, int(count)))
    return stacks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_summary")
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--group", action="store_true", help="bucket time into the areas of a tool call")
    args = parser.parse_args(argv)
    stacks = parse(args.profile)
    total = sum(count for _, count in stacks) or 1
    print(f"{total} samples")
    if args.group:
        groups: Counter[str] = Counter()
        for frames, count in stacks:
            name = "other"
            for _func, file in reversed(frames):
                hit = next((g for g, marks in GROUPS if any(m in file for m in marks)), None)
                if hit is not None:
                    name = hit
                    break
            groups[name] += count
        for name, count in groups.most_common():
            print(f"{100 * count / total:6.1f}%  {name}")
        return
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for frames, count in stacks:
        names = [f"{func} ({file})" for func, file in frames]
        own[names[-1]] += count
        for name in set(names):
            inclusive[name] += count
    print("\nself:")
    for name, count in own.most_common(args.top):
        print(f"{100 * count / total:6.1f}%  {name}")
    print("\ninclusive:")
    for name, count in inclusive.most_common(args.top):
        print(f"{100 * count / total:6.1f}%  {name}")


if __name__ == "__main__":
    main()
