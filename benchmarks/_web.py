"""The status page's cost: ``python _web.py FOLDER SECONDS``, one JSON object on stdout.

Makes FOLDER/jobs.db with 10,000 jobs and 1,000,000 records (100 a job, an hour apart), and a job
``second`` with a day of records one second apart (86,400); starts ``anarchon-lite web`` on it and
measures how long each page takes to answer (20 requests each, after one that warms up; the jobs
page also once a second, when every job's status is read again). Then,
with a scheduler process running a job every second on the same file, the page's process's CPU
and resident memory over SECONDS with no page listening, with 50 (server-sent events, each
read to its end as a browser would), and with 50 timelines of a day of the job every second, each
drawn again at most every 5 s while changes are told, as the page's script does.
"""

import asyncio
import http.client
import json
import os
import re
import selectors
import socket
import sqlite3
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import _history  # (this folder is on the path: the script's own)

from anarchon_lite import Scheduler, StatusPage

FOLDER, SECONDS = sys.argv[1], float(sys.argv[2])
DB = os.path.join(FOLDER, "jobs.db")
JOBS, PER_JOB, DAY = 10_000, 100, 86_400
TICKS = os.sysconf("SC_CLK_TCK")


async def declare() -> None:
    scheduler = Scheduler(DB)
    for i in range(JOBS):
        scheduler.every(f"job-{i}", "1h", lambda ctx: None)
    scheduler.every("second", "1s", lambda ctx: None)
    async with scheduler:
        pass


def fill() -> int:
    now = int(time.time() * 1000)
    conn = sqlite3.connect(DB, isolation_level=None)
    conn.execute("BEGIN")
    conn.executemany(_history.INSERT, _history.hourly(JOBS, PER_JOB, now))
    seconds = ((now // 1000 - DAY + k) * 1000 for k in range(DAY))
    conn.executemany(_history.INSERT, (("second", slot, "succeeded", slot, slot + 20, None) for slot in seconds))
    conn.execute("COMMIT")
    rows = conn.execute("SELECT count(*) FROM history").fetchone()[0]
    conn.close()
    return int(rows)


def start_web() -> tuple[subprocess.Popen[str], str, int]:
    command = [sys.executable, "-m", "anarchon_lite", "--db", DB, "web", "--listen", "127.0.0.1:0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    url = re.search(r"http://127\.0\.0\.1:(\d+)/", proc.stdout.readline())
    assert url is not None, "the page did not start"
    return proc, url.group(0), int(url.group(1))


def answer_ms(port: int, path: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    start = time.perf_counter()
    conn.request("GET", path)
    reply = conn.getresponse()
    body = reply.read()
    took = (time.perf_counter() - start) * 1000
    conn.close()
    assert reply.status == 200, (path, reply.status, body[:200])
    return took


async def drawing_ms(times: int) -> list[float]:
    """How long the timeline of a day of ``second`` takes to draw, each time anew (the page keeps
    a drawing for up to a minute over a day: the pages above are answered from it)."""
    page = StatusPage(Scheduler(DB, read_only=True), "127.0.0.1:0")
    until = int(time.time() * 1000)
    took = []
    for _ in range(times + 1):
        page._drawn.clear()
        start = time.perf_counter()
        await page._timeline(["second"], until - 86_400_000, until, "1d")
        took.append((time.perf_counter() - start) * 1000)
    page.scheduler.close()
    return took[1:]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def cpu_and_rss(pid: int) -> tuple[float, float]:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    with open(f"/proc/{pid}/status") as handle:
        rss = next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))
    return (int(fields[11]) + int(fields[12])) / TICKS, rss / 1024


def listen(port: int, count: int, stop: threading.Event, timeline: str = "") -> tuple[threading.Thread, list[int]]:
    """``count`` pages listening to /events, read by one thread until ``stop``; the bytes of the
    events each was told. With ``timeline`` (a timeline's path), each page also fetches its drawing
    again at most every 5 s while it is told of changes, as the page's script does."""
    got = [0] * count
    fetched = [0.0] * count
    chooser = selectors.DefaultSelector()
    for n in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n")
        sock.setblocking(False)
        chooser.register(sock, selectors.EVENT_READ, n)

    def read() -> None:
        while not stop.is_set():
            for key, _ in chooser.select(0.2):
                data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                told = sum(len(line) for line in data.split(b"\n") if line.startswith(b"data: "))
                got[key.data] += told
                if told and timeline and time.monotonic() - fetched[key.data] >= 5.0:
                    fetched[key.data] = time.monotonic()
                    answer_ms(port, timeline)
        for key in list(chooser.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]

    thread = threading.Thread(target=read)
    thread.start()
    return thread, got


def main() -> dict[str, object]:
    asyncio.run(declare())
    rows = fill()
    web, _, port = start_web()
    beating = None
    try:
        paths = {
            "jobs, first page": "/",
            "jobs, page 50": "/?page=50",
            "a job's page (history of 100)": "/job/job-7",
            "timeline of a day, first 50 jobs": "/timeline?span=1d",
            "timeline of a day of a job every second": "/timeline?span=1d&job=second",
            "timeline of a week, first 50 jobs": "/timeline?span=1w",
            "/api/status (10,000 jobs)": "/api/status",
        }
        pages: dict[str, object] = {}
        for name, path in paths.items():
            answer_ms(port, path)
            times = [answer_ms(port, path) for _ in range(20)]
            pages[name] = {"p50_ms": percentile(times, 50), "p99_ms": percentile(times, 99), "max_ms": max(times)}
        times = asyncio.run(drawing_ms(20))
        pages["timeline of a day of a job every second, drawn anew"] = {
            "p50_ms": percentile(times, 50),
            "p99_ms": percentile(times, 99),
            "max_ms": max(times),
        }
        # The page reads every job's status at most once a second, whatever the number of viewers:
        # the jobs page when its status must be read again (one request a second).
        times = []
        for _ in range(10):
            time.sleep(1.05)
            times.append(answer_ms(port, "/"))
        pages["jobs, first page, status read again"] = {
            "p50_ms": percentile(times, 50),
            "p99_ms": percentile(times, 99),
            "max_ms": max(times),
        }
        script = os.path.join(FOLDER, "beat.py")
        with open(script, "w") as handle:
            handle.write(
                "import asyncio, sys\nfrom anarchon_lite import Scheduler\ns = Scheduler(sys.argv[1])\n"
                "s.every('beat', '1s', lambda ctx: 'ok')\nasyncio.run(s.run())\n"
            )
        env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
        beating = subprocess.Popen([sys.executable, script, DB], env=env)
        time.sleep(3.0)  # (the scheduler joins and runs its first beats)
        live: dict[str, object] = {}
        for count, timeline in ((0, ""), (50, ""), (50, "/timeline?span=1d&job=second&svg=1")):
            stop = threading.Event()
            reader, got = listen(port, count, stop, timeline)
            time.sleep(2.0)
            cpu0, rss0 = cpu_and_rss(web.pid)
            time.sleep(SECONDS)
            cpu1, rss1 = cpu_and_rss(web.pid)
            stop.set()
            reader.join()
            live[f"{count} {'timeline pages' if timeline else 'pages'}"] = {
                "cpu_share_of_a_core": (cpu1 - cpu0) / SECONDS,
                "rss_mb": rss1,
                "rss_growth_mb": rss1 - rss0,
                "bytes_told_per_page_per_s": (sum(got) / count / SECONDS) if count else 0.0,
                "pages_told": sum(1 for n in got if n),  # (of an event: the answer's head is not counted)
            }
        return {"jobs": JOBS + 1, "records": rows, "pages": pages, "live": live, "seconds": SECONDS}
    finally:
        for proc in (web, beating):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)


print(json.dumps(main()), flush=True)
