"""The README's benchmark tables from a results file: ``python benchmarks/table.py results.json``.

Prints Markdown: every heartbeat mode against its goal, the other figures against theirs, and the
peers side by side. A goal is judged on the figure as measured; a miss is printed as missed.
"""

from __future__ import annotations

import json
import sys
from typing import Any

GOALS_P99_MS = {"idle": 2, "chunks": 5, "thread": 12, "process": 5, "blocking": 12, "busy_cores": 15, "contended": 10}
PEER_NAMES = {
    "anarchon_lite": "anarchon_lite",
    "apscheduler3": "APScheduler 3.11 (`AsyncIOScheduler`, SQLAlchemy job store on SQLite)",
    "apscheduler4": "APScheduler 4.0.0a6 (`AsyncScheduler`, SQLAlchemy data store on SQLite)",
}


def verdict(met: bool) -> str:
    return "met" if met else "**missed**"


def heartbeat_rows(modes: dict[str, Any]) -> list[str]:
    lines = [
        "| heartbeat mode (lease 1 s) | repetitions | renewals | p50 ms | p99 ms | p99 of each repetition | max ms | lost | goal p99 | |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, h in modes.items():
        goal = GOALS_P99_MS.get(mode)
        name = "contended (4 processes)" if mode == "contended" else mode
        if "gil_held_s" in h:
            judged, target = "", f"none: one C call held the GIL {h['gil_held_s']:.1f} s (the limit)"
        elif goal is None:
            judged, target = "", "(default 5 ms switch interval)"
        else:
            judged, target = verdict(h["p99_ms"] <= goal and h["lost_leases"] == 0), f"≤ {goal}"
        each = ", ".join(f"{r['p99_ms']:.2f}" for r in h["repetitions"])
        lines.append(
            f"| {name} | {len(h['repetitions'])} | {h['renewals']} | {h['p50_ms']:.2f} | {h['p99_ms']:.2f} | {each} "
            f"| {h['max_ms']:.1f} | {h['lost_leases']} | {target} | {judged} |"
        )
    return lines


def row(figure: str, measured: str, goal: str = "", met: bool | None = None) -> str:
    return f"| {figure} | {measured} | {goal} | {'' if met is None else verdict(met)} |"


def figure_rows(r: dict[str, Any]) -> list[str]:
    kill, hand = r["takeover"]["kill9_s"], r["takeover"]["handover_s"]
    single, four = r["start_lateness_ms"]["single"], r["start_lateness_ms"]["four_processes"]
    idle, switch = r["idle"], r["switch_interval_cost"]
    cpu = f"{idle['cpu_s_per_hour']:.2f}" if idle["cpu_s_per_hour"] else f"< {idle['cpu_resolution_s_per_hour']:.2f}"
    idle_cost = (
        f"{idle['wakeups_per_min']:.1f} wake-ups/min, {cpu} CPU s/hour, {idle['rss_mb']:.1f} MB RSS, "
        f"{idle['db_writes_per_hour']:.0f} database writes/hour"
    )
    idle_met = (idle["cpu_s_per_hour"] or 0) <= 1 and idle["db_writes_per_hour"] == 0
    return [
        "| figure | measured | goal | |",
        "|---|---|---|---|",
        row(
            f"takeover after `kill -9`, lease 30 s ({kill['n']} trials)",
            f"p50 {kill['p50']:.3f} s, max {kill['max']:.3f} s",
            "p50 ≤ 1 s",
            kill["p50"] <= 1,
        ),
        row(
            f"hand-over after SIGTERM ({hand['n']} trials)",
            f"p50 {hand['p50']:.3f} s, max {hand['max']:.3f} s",
            "p50 ≤ 0.5 s",
            hand["p50"] <= 0.5,
        ),
        row("start lateness, one process", f"p50 {single['p50']:.2f} ms, p99 {single['p99']:.2f} ms"),
        row(
            "start lateness, four processes",
            f"p50 {four['p50']:.2f} ms, p99 {four['p99']:.2f} ms",
            "p99 ≤ 20 ms",
            four["p99"] <= 20,
        ),
        row(f"idle: 10 hourly jobs, {idle['seconds']:.0f} s", idle_cost, "CPU ≤ 1 s/hour, 0 writes", idle_met),
        row("duplicate runs, four processes", str(four["duplicates"]), "0", four["duplicates"] == 0),
        row(
            "two computing threads: work done at 0.5 ms / 5 ms switch interval",
            f"{switch['ratio_0_5ms_to_5ms']:.3f}",
        ),
        row(
            "two threads computing in a handler: work done, interval lowered around renewals / left at 5 ms",
            f"{switch['ratio_scheduler_lowered_to_left']:.3f}",
        ),
    ]


def peer_rows(peers: dict[str, Any], seconds: float) -> list[str]:
    lines = [
        f"Side by side, four processes declaring one job every second, {seconds:.0f} s, same run:",
        "",
        "| | runs | duplicates | start lateness p50 | p99 | idle CPU s/hour |",
        "|---|---|---|---|---|---|",
    ]
    for key, v in peers.items():
        if "error" in v:
            lines.append(f"| {PEER_NAMES[key]} | not measured: {v['error']} | | | | |")
        else:
            lines.append(
                f"| {PEER_NAMES[key]} | {v['runs']} | {v['duplicates']} | {v['lateness_p50_ms']:.1f} ms "
                f"| {v['lateness_p99_ms']:.1f} ms | {v['idle_cpu_s_per_hour']:.2f} |"
            )
    return lines


def main() -> int:
    with open(sys.argv[1]) as handle:
        r = json.load(handle)
    m = r["machine"]
    lines = [f"Measured on {m['date'][:10]}, Python {m['python']}, SQLite {m['sqlite']}, {m['cores']} cores.", ""]
    lines += heartbeat_rows(r["heartbeat"]) + [""] + figure_rows(r)
    if "peers" in r:
        lines += [""] + peer_rows(r["peers"], r["start_lateness_ms"]["four_processes"].get("seconds", float("nan")))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
