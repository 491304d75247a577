"""Counts the calls of the store's and the loop's methods in a benchmark worker, and the CPU of
the calling thread in each (``time.thread_time``, what it spent inside, callees included): put this
folder first on ``$PYTHONPATH`` of the workers (``run.store_costs`` does). SIGUSR2 starts the count
afresh; at exit the counts go, as JSON, to ``$BENCH_COSTS.PID``. The wrapping costs about a
microsecond a call: compare the calls with each other, not with an unwrapped run's CPU."""

from __future__ import annotations

import atexit
import builtins
import inspect
import json
import os
import signal
import time
from typing import Any

COUNTS: dict[str, list[float]] = {}
CLASSES = ("_SQLStore", "_SQLiteFile", "_SQLiteStore", "_SQLiteChanges", "_PGStore", "_PGChanges", "_Alive")
CLASSES += ("_StoreLink", "_StoreThread", "_Loop", "_Agenda", "_Runner", "_Heartbeats", "_Watchdog", "_Timers")


def _counted(key: str, function: Any) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        began = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            spent = COUNTS.setdefault(key, [0, 0.0])
            spent[0] += 1
            spent[1] += time.thread_time() - began

    return counted


def _wrap(module: Any) -> None:
    for name in CLASSES:
        cls = getattr(module, name, None)
        for attribute, value in list(vars(cls).items()) if cls is not None else []:
            if attribute.startswith("__") or not inspect.isfunction(value) or inspect.iscoroutinefunction(value):
                continue
            if getattr(value, "__isabstractmethod__", False) or attribute in ("run", "_serve"):  # (a thread's life)
                continue
            setattr(cls, attribute, _counted(f"{name}.{attribute}", value))
    for name in ("_met",):
        if hasattr(module, name):
            setattr(module, name, _counted(name, getattr(module, name)))


def _dump() -> None:
    path = os.environ.get("BENCH_COSTS")
    if path:
        with open(f"{path}.{os.getpid()}", "w") as handle:
            json.dump(COUNTS, handle)


_import = builtins.__import__


def _importing(name: str, *args: Any, **kwargs: Any) -> Any:
    module = _import(name, *args, **kwargs)
    if name == "anarchon_lite" and not getattr(module, "_bench_costs", False):
        module._bench_costs = True
        _wrap(module)
    return module


if os.environ.get("BENCH_COSTS"):
    builtins.__import__ = _importing
    atexit.register(_dump)
    signal.signal(signal.SIGUSR2, lambda *_: COUNTS.clear())
