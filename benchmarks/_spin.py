"""Two threads computing together: the work the GIL switch interval's price is measured in."""

from __future__ import annotations

import threading
import time


def two_threads(seconds: float) -> int:
    """Iterations that two threads, each computing for ``seconds``, get done between them."""
    counts = [0, 0]

    def spin(i: int) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            counts[i] += sum(range(200)) > 0

    other = threading.Thread(target=spin, args=(1,))
    other.start()
    spin(0)
    other.join()
    return sum(counts)
