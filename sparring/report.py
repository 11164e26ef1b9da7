"""The figures of a run (`sparring eval`) and of a canary suite (`sparring canary`), as JSON and as tables.

Item statistics follow the review pages' definitions: population variance; an item is "always 0" /
"always 1" when it has at least 2 graded rollouts and every score is ≤ 0 / ≥ 1, and the shares are over
such items. The mean reward's standard error is clustered by item, and pass@k / pass^k (a rollout passes
with a score of at least the pass threshold) come with theirs (sparring.stats).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from sparring.evaluate import FinishedRollout
from sparring.stats import clustered_stderr, pass_table

MIN_ROLLOUTS_PER_ITEM = 2
PASS_SCORE = 0.5


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _pstd(values: Sequence[float]) -> float | None:
    mean = _mean(values)
    if mean is None:
        return None
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def discard_kind(reason: str) -> str:
    """`tool_failed: lookup: HTTP 503 ...` → `tool_failed`."""
    return reason.split(":", 1)[0]


DISCARD_GROUPS_SHOWN = 10
DISCARD_REASON_CHARS = 400


def discard_groups(reasons: Sequence[str]) -> list[dict[str, Any]]:
    """The discard reasons of a run, one entry per distinct reason with its count, most frequent first:
    what the screen shows, so a run that failed for one cause says it once, not per rollout."""
    counts = Counter(reason[:DISCARD_REASON_CHARS] for reason in reasons)
    return [{"reason": reason, "count": count} for reason, count in counts.most_common()]


def discard_verdict(run: int, graded: int, discarded: int, max_discarded_pct: float | None) -> str | None:
    """Why the run failed for its discards, or None: nothing could be graded, or more than
    `max_discarded_pct` percent of the rollouts run were discarded."""
    if run == 0:
        return None
    if graded == 0 and discarded > 0:
        return f"no rollout could be graded: all {discarded} were discarded (the reasons are above)"
    share = 100.0 * discarded / run
    if max_discarded_pct is not None and share > max_discarded_pct:
        return (
            f"{discarded} of {run} rollouts ({share:.1f}%) were discarded, more than "
            f"--max-discarded {max_discarded_pct:g}%"
        )
    return None


def format_discards(groups: Sequence[dict[str, Any]]) -> list[str]:
    """The grouped discard reasons as lines for the screen (nothing when no rollout was discarded)."""
    if not groups:
        return []
    lines = ["", "discarded, by reason:"]
    for group in groups[:DISCARD_GROUPS_SHOWN]:
        lines.append(f"  {group['count']:>5}  {group['reason']}")
    if len(groups) > DISCARD_GROUPS_SHOWN:
        rest = sum(group["count"] for group in groups[DISCARD_GROUPS_SHOWN:])
        lines.append(f"  {rest:>5}  (other reasons: see the report's discards)")
    return lines


def build_report(
    records: Sequence[FinishedRollout],
    *,
    run: str,
    review_url: str | None,
    planned: int,
    resumed: int,
    wall_time_s: float,
    interrupted: bool,
    pass_threshold: float = PASS_SCORE,
    user_model: str | None = None,
) -> dict[str, Any]:
    """The run's report; `records` holds one record per rollout (resumed ones included). `user_model`
    names the model that played the simulated user, if one did."""
    graded = [r for r in records if r.graded]
    discarded = [r for r in records if r.discarded is not None]
    scores = [r.score for r in graded if r.score is not None]
    by_item = _scores_by_item(graded)
    items = _per_item(by_item)
    repeated_items = [i for i in items if i["rollouts"] >= MIN_ROLLOUTS_PER_ITEM]
    always_zero = [i["item"] for i in items if i["always_zero"]]
    always_one = [i["item"] for i in items if i["always_one"]]
    done = [r for r in records if r.discarded is None]
    return {
        "run": run,
        "user_model": user_model,
        "review_url": review_url,
        "interrupted": interrupted,
        "rollouts": {
            "planned": planned,
            "run": len(records),
            "resumed": resumed,
            "graded": len(graded),
            "discarded": len(discarded),
            "discarded_by_reason": dict(Counter(discard_kind(r.discarded) for r in discarded if r.discarded)),
            "ended_by": dict(Counter(r.ended_by for r in records)),
        },
        "reward": {
            "mean": _mean(scores),
            "std": _pstd(scores),
            "stderr": clustered_stderr(list(by_item.values())),
        },
        "pass": {"threshold": pass_threshold, "by_k": pass_table(by_item, pass_threshold)},
        "items": {
            "count": len(items),
            "repeated": len(repeated_items),
            "always_zero": always_zero,
            "always_one": always_one,
            "share_always_zero": len(always_zero) / len(repeated_items) if repeated_items else None,
            "share_always_one": len(always_one) / len(repeated_items) if repeated_items else None,
            "per_item": items,
        },
        "calls_per_rollout": _mean([float(r.calls) for r in done]),
        "tool_calls": sum(r.calls for r in records),
        "tool_errors": sum(r.tool_errors for r in records),
        "tokens": {
            "input": sum(r.input_tokens for r in records),
            "output": sum(r.output_tokens for r in records),
            "total": sum(r.input_tokens + r.output_tokens for r in records),
        },
        "wall_time_s": round(wall_time_s, 3),
        "discards": [{"trace_id": r.trace_id, "item": r.item_key, "reason": r.discarded} for r in discarded],
        "discard_reasons": discard_groups([r.discarded for r in discarded if r.discarded]),
    }


def _scores_by_item(graded: Sequence[FinishedRollout]) -> dict[str, list[float]]:
    """The graded rollouts' scores, by item key (sorted)."""
    by_item: dict[str, list[float]] = defaultdict(list)
    for record in graded:
        if record.score is not None:
            by_item[record.item_key].append(record.score)
    return {key: by_item[key] for key in sorted(by_item)}


def _per_item(by_item: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Each item's rewards over its graded rollouts, by item key; `always_zero`/`always_one` only
    for items with enough rollouts to tell (an item whose reward never varies teaches nothing)."""
    items: list[dict[str, Any]] = []
    for key in sorted(by_item):
        values = by_item[key]
        mean = sum(values) / len(values)
        repeated = len(values) >= MIN_ROLLOUTS_PER_ITEM
        items.append(
            {
                "item": key,
                "rollouts": len(values),
                "mean": mean,
                "variance": sum((v - mean) ** 2 for v in values) / len(values),
                "always_zero": repeated and max(values) <= 0.0,
                "always_one": repeated and min(values) >= 1.0,
            }
        )
    return items


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows)


def _plus_minus(value: float | None, stderr: float | None) -> str:
    return _fmt(value) if stderr is None else f"{_fmt(value)} ± {_fmt(stderr)}"


def _mean_reward(reward: dict[str, Any]) -> str:
    """`0.600 ± 0.120 (std 0.490)`: the mean, its standard error (clustered by item), the spread."""
    return f"{_plus_minus(reward['mean'], reward['stderr'])} (std {_fmt(reward['std'])})"


def _pass_rows(passed: dict[str, Any]) -> list[tuple[str, str]]:
    """One row per k: pass@k and pass^k with their standard errors, over how many items."""
    return [
        (
            f"pass@{row['k']}",
            f"{_plus_minus(row['pass_at_k'], row['pass_at_k_stderr'])}   pass^{row['k']} "
            f"{_plus_minus(row['pass_hat_k'], row['pass_hat_k_stderr'])}   ({row['items']} items, "
            f"score >= {passed['threshold']:g})",
        )
        for row in passed["by_k"]
    ]


def format_report(report: dict[str, Any]) -> str:
    rollouts, items = report["rollouts"], report["items"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(rollouts["discarded_by_reason"].items())) or "-"
    rows = [
        ("run", report["run"]),
        *([("user model", report["user_model"])] if report.get("user_model") else []),
        ("rollouts run", f"{rollouts['run']} of {rollouts['planned']} ({rollouts['resumed']} from before)"),
        ("graded", str(rollouts["graded"])),
        ("discarded", f"{rollouts['discarded']} ({reasons})"),
        ("mean reward", _mean_reward(report["reward"])),
        *_pass_rows(report["pass"]),
        ("items", f"{items['count']} ({items['repeated']} with 2+ graded rollouts)"),
        ("always 0", f"{len(items['always_zero'])} (share {_fmt(items['share_always_zero'], 2)})"),
        ("always 1", f"{len(items['always_one'])} (share {_fmt(items['share_always_one'], 2)})"),
        ("calls per rollout", _fmt(report["calls_per_rollout"], 2)),
        ("tool errors", f"{report['tool_errors']} of {report['tool_calls']} calls"),
        (
            "tokens",
            f"{report['tokens']['total']} (in {report['tokens']['input']}, out {report['tokens']['output']})",
        ),
        ("wall time", f"{report['wall_time_s']:.1f} s"),
    ]
    if report["interrupted"]:
        rows.append(("interrupted", "yes: run again with --resume to finish"))
    if report["review_url"]:
        rows.append(("review", report["review_url"]))
    lines = [_table(rows)]
    per_item = items["per_item"]
    if per_item:
        lines.append("")
        item_rows = [("ITEM", "ROLLOUTS", "MEAN", "VARIANCE", "SIGNAL")]
        for entry in per_item:
            signal = "always 0" if entry["always_zero"] else "always 1" if entry["always_one"] else ""
            item_rows.append(
                (entry["item"], str(entry["rollouts"]), _fmt(entry["mean"]), _fmt(entry["variance"]), signal)
            )
        lines.append(_table(item_rows))
    lines += format_discards(report["discard_reasons"])
    return "\n".join(lines)


# A grader change that gives each canary 0 (checked by the tests of the graders named).
CANARY_FIXES = {
    "empty": "compare the answer with the reference (string_check eq, or a judge), and check that the "
    "reference is not empty",
    "refuse": "compare with the reference exactly (string_check eq) or with a judge, not a loose like/ilike "
    "on a short reference",
    "parrot": "compare with a reference the prompt does not contain (the grader rewards copying the "
    "question)",
    "loop": "multiply in no_loops or tool_budget (a multi grader), or grade the final state with a state "
    "check",
    "guess": "multiply in grounded (0 when no call was answered) or required_tools, or grade the final "
    "state with a state check",
}


def canary_report(
    records: Sequence[FinishedRollout],
    *,
    threshold: float,
    gold_minimum: float,
    policies: Sequence[str],
    grader: str | None = None,
) -> dict[str, Any]:
    """Per policy: mean score, share of rollouts above 0.5, the items scored above 0.5, the grader that let
    it through and a fix that stops it; and the verdict.

    The suite fails when a policy other than `gold` averages at least `threshold`, or `gold` averages
    below `gold_minimum`. Discarded rollouts are counted, not scored.
    """
    rows = []
    failures = []
    for policy in policies:
        mine = [r for r in records if r.policy == policy]
        graded = [r for r in mine if r.graded and r.score is not None]
        scores = [r.score for r in graded if r.score is not None]
        passed = sorted({r.item_key for r in graded if r.score is not None and r.score > PASS_SCORE})
        mean = _mean(scores)
        row = {
            "policy": policy,
            "rollouts": len(mine),
            "graded": len(graded),
            "discarded": len(mine) - len(graded),
            "mean": mean,
            "share_above_half": (sum(1 for s in scores if s > PASS_SCORE) / len(scores)) if scores else None,
            "items_above_half": passed,
            "let_through_by": None,
            "fix": None,
        }
        rows.append(row)
        if mean is None:
            continue
        if policy == "gold":
            if mean < gold_minimum:
                failures.append(f"gold averages {mean:.3f} < {gold_minimum}: the grader misses correct work")
        elif mean >= threshold:
            fix = CANARY_FIXES.get(policy)
            row["let_through_by"], row["fix"] = grader or "the grader", fix
            failures.append(
                f"{policy} averages {mean:.3f} >= {threshold}: the grader can be gamed"
                f" (let through by {row['let_through_by']}){'; fix: ' + fix if fix else ''}"
            )
    return {
        "grader": grader,
        "threshold": threshold,
        "gold_minimum": gold_minimum,
        "policies": rows,
        "failures": failures,
        "discard_reasons": discard_groups([r.discarded for r in records if r.discarded]),
    }


def format_canaries(report: dict[str, Any]) -> str:
    rows = [("POLICY", "ROLLOUTS", "DISCARDED", "MEAN", "ABOVE 0.5")]
    for row in report["policies"]:
        rows.append(
            (
                row["policy"],
                str(row["rollouts"]),
                str(row["discarded"]),
                _fmt(row["mean"]),
                _fmt(row["share_above_half"], 2),
            )
        )
    lines = [_table(rows), ""]
    for row in report["policies"]:
        if row["items_above_half"]:
            lines.append(f"{row['policy']} scored above 0.5 on: {', '.join(row['items_above_half'])}")
    for policy, url in (report.get("review_urls") or {}).items():
        if url:
            lines.append(f"review {policy}: {url}")
    lines += format_discards(report["discard_reasons"])
    if report["failures"]:
        lines += ["", "FAIL:", *(f"  {failure}" for failure in report["failures"])]
    elif any(row["graded"] for row in report["policies"]):
        lines += ["", "ok: no canary games the grader, and gold scores"]
    return "\n".join(lines)
