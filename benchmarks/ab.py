"""Measurements of ``run.py`` on two trees, alternated in one session so that the machine's noise
falls on both alike.

``python benchmarks/ab.py OLD_TREE [--rounds N] [--json PATH]``: OLD_TREE is a folder holding the
``anarchon_lite.py`` to compare with (a ``git worktree`` of an older commit); the other is this
checkout's. Without ``--call``, the PostgreSQL busy measurement (``pgcost_busy``: 1,000 jobs every
10 s on four processes); prints each round and the medians.

``--call EXPR`` (again for more): each round evaluates each expression of this checkout's ``run``
module (``run.sweep_one(16, 20, 30)``, ``run.burst(DB, 10000, 1)`` with ``DB`` a fresh file, ...)
once with each tree's ``anarchon_lite``, in a fresh interpreter each time, the trees' order turned
round every round; prints one JSON line a measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import run  # (this folder first)

sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import pgserver  # (the tests' throwaway server)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="a folder holding the anarchon_lite.py to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write every round's figures here")
    parser.add_argument("--call", action="append", default=[], help="an expression of run's to measure (see above)")
    args = parser.parse_args()
    trees = {"old": os.path.abspath(args.old), "new": os.path.dirname(HERE)}
    if args.call:
        return calls(trees, args.call, args.rounds, args.json)
    numbers = itertools.count()
    cost = run.ServerCost
    run.ServerCost = lambda server, database: cost(server, f"{database}_{next(numbers)}")  # (one database a round)
    run.STORE["server"] = pgserver.Server.start()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    try:
        for round_ in range(args.rounds):
            for name, tree in trees.items():
                os.environ["PYTHONPATH"] = tree  # (the workers import the anarchon_lite found there)
                r = run.pgcost_busy(4, 1_000, 10.0, 15.0)
                r.pop("top_statements", None)
                results[name].append(r)
                print(
                    f"{name} {round_}: CPU per occurrence {r['cpu_per_occurrence_ms']:.2f} ms"
                    f" (schedulers {r['schedulers_cpu_per_occurrence_ms']:.2f}, server"
                    f" {r['server_cpu_per_occurrence_ms']:.2f}), lateness p99 {r['lateness_p99_ms']:.1f} ms,"
                    f" {r['statements_per_occurrence']:.1f} statements, {r['duplicates']} duplicates, {r['modules']}",
                    flush=True,
                )
    finally:
        run.STORE["server"].stop()
    for name, rounds in results.items():
        cpu = [r["cpu_per_occurrence_ms"] for r in rounds]
        p99 = [r["lateness_p99_ms"] for r in rounds]
        print(
            f"{name}: median CPU per occurrence {statistics.median(cpu):.2f} ms, median p99 {statistics.median(p99):.1f} ms"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


def calls(trees: dict[str, str], expressions: list[str], rounds: int, path: str | None) -> int:
    """Each expression, with each tree's module, round after round (see the module's text)."""
    results = []
    for round_ in range(rounds):
        order = list(trees.items()) if round_ % 2 == 0 else list(trees.items())[::-1]
        for expression in expressions:
            for name, tree in order:
                code = (
                    "import json, os, tempfile, run, anarchon_lite\n"
                    "DB = os.path.join(tempfile.mkdtemp(), 'ab.db')\n"
                    f"print(json.dumps({{'module': anarchon_lite.__file__, 'result': {expression}}}))"
                )
                env = {**os.environ, "PYTHONPATH": tree}  # (the workers and this one import the tree's)
                done = subprocess.run(
                    [sys.executable, "-c", code], check=False, cwd=HERE, env=env, capture_output=True, text=True
                )
                if done.returncode != 0:
                    print(f"{name} {round_} {expression}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
                    return 1
                found = json.loads(done.stdout.strip().splitlines()[-1])
                if not found["module"].startswith(tree):
                    print(f"{name}: imported {found['module']}, not the tree's", file=sys.stderr)
                    return 1
                line = {"tree": name, "round": round_, "call": expression, "result": found["result"]}
                results.append(line)
                print(json.dumps(line), flush=True)
    if path:
        with open(path, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
