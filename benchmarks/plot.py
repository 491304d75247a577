"""Draw the benchmark figures: heartbeat lateness CDFs, and the peers side by side."""

from __future__ import annotations

from typing import Any


def draw(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for mode, figures in results["heartbeat"].items():
        samples = sorted(max(s, 1e-3) for s in figures.get("samples_ms", []))
        if samples:
            shares = [(i + 1) / len(samples) for i in range(len(samples))]
            reps = len(figures.get("repetitions", []))
            of = f", median of {reps}" if reps > 1 else ""
            illustration = mode.endswith("_5ms") or "gil_held_s" in figures
            left.step(
                samples,
                shares,
                where="post",
                linestyle="--" if illustration else "-",
                label=f"{mode} (p99 {figures['p99_ms']:.1f} ms{of})",
            )
    left.set_xscale("log")
    left.set_xlabel("heartbeat lateness, ms (log scale)")
    left.set_ylabel("share of renewals")
    left.set_title("Lease renewals: how late against plan (lease 1 s)")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)

    peers = {name: r for name, r in results.get("peers", {}).items() if "error" not in r}
    names = list(peers)
    positions = range(len(names))
    right.bar([p - 0.2 for p in positions], [peers[n]["duplicates"] for n in names], 0.4, label="duplicate runs")
    right.bar(
        [p + 0.2 for p in positions], [peers[n]["lateness_p99_ms"] for n in names], 0.4, label="start lateness p99, ms"
    )
    right.set_xticks(list(positions))
    right.set_xticklabels(names)
    right.set_title("Four processes, one job every second")
    right.legend(fontsize=8)
    right.grid(True, axis="y", alpha=0.3)
    m = results["machine"]
    figure.suptitle(
        f"anarchon_lite benchmarks: {m['date']}, Python {m['python']}, SQLite {m['sqlite']}, {m['cores']} cores"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def draw_scale(results: dict[str, Any], path: str) -> None:
    """CPU per hour and start lateness p99 against the number of jobs ``every 1m`` (log scales),
    this project and APScheduler 4 on the same workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    section = results["scale"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in (
        ("anarchon_lite", section["busy"]),
        ("APScheduler 4.0.0a6", section.get("busy_apscheduler4", [])),
    ):
        if not rows:
            continue
        jobs = [r["jobs"] for r in rows]
        left.plot(jobs, [max(r["cpu_share"] * 3600, 1e-2) for r in rows], marker="o", label=name)
        right.plot(jobs, [max(r["p99_ms"] or 0.0, 1e-1) for r in rows], marker="o", label=name)
        for r in rows:  # a scheduler that fell behind ran fewer occurrences than came due
            if r.get("expected") and r["occurrences"] < 0.95 * r["expected"]:
                shown = f"ran {r['occurrences']:,} of {r['expected']:,} due"
                right.annotate(
                    shown, (r["jobs"], r["p99_ms"]), textcoords="offset points", xytext=(-110, -4), fontsize=8
                )
    for axes, label in ((left, "CPU seconds per hour"), (right, "start lateness p99, ms")):
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("jobs, each every minute, spread over the minute (log scale)")
        axes.set_ylabel(f"{label} (log scale)")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8)
    left.set_title("CPU of one process")
    right.set_title("How late runs start")
    m = results["machine"]
    figure.suptitle(f"Many jobs, SQLite, one process: {m['date']}, Python {m['python']}, {m['cores']} cores")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def draw_sweep(results: dict[str, Any], path: str) -> None:
    """CPU per occurrence against the number of processes sharing one SQLite file (20 jobs every
    second), this project beside APScheduler 3 and 4 on the same axes; a peer's duplicate runs
    are marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    section = results["sweep"]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    lines = [("anarchon_lite", section["runs"])]
    lines += [(name.replace("apscheduler", "APScheduler "), rows) for name, rows in section.get("peers", {}).items()]
    for name, rows in lines:
        if not isinstance(rows, list) or not rows:
            continue
        counts = [r["processes"] for r in rows]
        axes.plot(counts, [r["cpu_per_occurrence_ms"] for r in rows], marker="o", label=name)
        for r in rows:
            if r["duplicates"]:
                shown = f"{r['duplicates']:,} duplicates"
                axes.annotate(
                    shown,
                    (r["processes"], r["cpu_per_occurrence_ms"]),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                )
    axes.axhline(section["two_commits_ms"], color="grey", linestyle=":", label="two bare WAL commits")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("processes sharing one SQLite file (log scale)")
    axes.set_ylabel("CPU ms per occurrence, all processes (log scale)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    m = results["machine"]
    figure.suptitle(f"20 jobs every second: {m['date']}, Python {m['python']}, {m['cores']} cores")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
