"""The status page (``anarchon-lite web``, ``StatusPage``): against a real scheduler process with
real runs, over HTTP, and in a real browser (headless Chromium driven by selenium)."""

import html
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.parse

import pytest
from conftest import stop_processes
from test_cli import ENV, ROOT, anarchon, cli, history, status_jobs, wait_until

APP = os.path.join(ROOT, "tests", "webapp.py")
ODD = ('a/b "<i>x</i>"', "..", ".", "é✓日本")  # (webapp.py's)
JOBS = {"tick", "work", "fail", "evil", *ODD}
EVIL = "<script>document.title='pwned'</script>"
TOKEN = "a-token-of-the-tests-0123456789"


def first_line(stream, timeout=30.0):
    """The first line a process writes, or an error after ``timeout`` seconds."""
    got = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not got or not got[0]:
        raise AssertionError(f"no line within {timeout} s")
    return got[0]


class Web:
    """A ``web`` command's process on ``store``, listening on a free port of loopback."""

    def __init__(self, store, *args, listen="127.0.0.1:0", env=None):
        command = [sys.executable, "-m", "anarchon_lite", "--db", store, "web", "--listen", listen, *args]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**ENV, **(env or {})}
        )
        try:
            line = first_line(self.proc.stdout)
        except AssertionError:
            self.close()
            raise AssertionError(f"the page did not start: {self.proc.stderr.read()}") from None
        self.url = re.search(r"http://\S+", line).group()
        parts = urllib.parse.urlsplit(self.url)
        self.host, self.port = parts.hostname, parts.port

    def request(self, path, method="GET", body=None, headers=None):
        """``(status, headers, text)`` of one request (redirects are not followed)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            reply = conn.getresponse()
            return reply.status, dict(reply.getheaders()), reply.read().decode()
        finally:
            conn.close()

    def get(self, path, **kw):
        status, _, text = self.request(path, **kw)
        assert status == 200, (path, status, text)
        return text

    def close(self):
        """End the process; ``log`` is then what it wrote to stderr."""
        stop_processes([self.proc])
        self.log = self.proc.stderr.read()
        self.proc.stdout.close()
        self.proc.stderr.close()


def declared(store):
    """The jobs the store has (none while it does not exist yet)."""
    done = anarchon("--db", store, "status", "--json")
    return {job["name"] for job in json.loads(done.stdout)["jobs"]} if done.returncode == 0 else set()


@pytest.fixture
def app(store, tmp_path):
    """A scheduler process running the jobs of ``webapp.py`` on the test's store."""
    with open(tmp_path / "app.log", "w") as log:
        proc = subprocess.Popen([sys.executable, APP, store], stdout=log, stderr=log, env=ENV)
    try:
        wait_until(lambda: declared(store) >= JOBS, what="the app's jobs")
        yield store
    finally:
        stop_processes([proc])


@pytest.fixture
def web(app):
    page = Web(app)
    try:
        yield page
    finally:
        page.close()


def ended(store, job):
    return [r for r in history(store, job) if r["status"] != "running"]


# -- over HTTP ----------------------------------------------------------------------------------


def test_the_pages_show_every_job_and_run_and_stored_markup_only_as_text(web, app):
    for job in ("fail", "evil"):
        cli(app, "trigger", job)
    wait_until(lambda: ended(app, "fail") and ended(app, "evil"), what="the triggered runs' ends")
    jobs = web.get("/")
    for job in ("tick", "work", "fail", "evil"):
        assert f'data-job="{job}"' in jobs
    evil = web.get("/job/evil")
    assert EVIL not in evil and "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;" in evil
    assert "the disk &lt;b&gt;is&lt;/b&gt; full" in web.get("/job/fail")
    assert re.search(r"<rect [^>]*>\s*<title>fail: failed, attempt 1", web.get("/timeline"))
    assert "webapp" in web.get("/processes")
    cli(app, "trigger", "work")  # (a run's checkpoint, on its job's page while it runs)
    wait_until(lambda: re.search(r"checkpoints of the unfinished runs.*{&quot;step&quot;: \d+}", web.get("/job/work")))
    # the same data as JSON, in the shapes of the command line's
    status = json.loads(web.get("/api/status"))
    command = json.loads(cli(app, "status", "--json").stdout)
    assert [j["name"] for j in status["jobs"]] == [j["name"] for j in command["jobs"]]
    assert set(status["jobs"][0]) == set(command["jobs"][0])
    assert status["processes"] == command["processes"]
    assert json.loads(web.get("/api/history?job=fail")) == history(app, "fail")
    assert any(s["job"] == "fail" and s["status"] == "failed" for s in json.loads(web.get("/api/timeline?span=1d")))


def test_bad_paths_methods_and_queries_get_one_line_never_a_traceback(web):
    for path, method, expected in (
        ("/nothing", "GET", 404),
        ("/job/no-such-job", "GET", 404),
        ("/job/a/b/c", "GET", 404),
        ("/api/nothing", "GET", 404),
        ("/", "DELETE", 405),
        ("/", "POST", 405),
        ("/?page=0", "GET", 400),
        ("/?page=x", "GET", 400),
        ("/?page=%C2%B2", "GET", 400),  # (a digit to str.isdigit, not to int)
        ("/?page=" + "9" * 5000, "GET", 400),
        ("/timeline?job=nope", "GET", 404),
        ("/control", "GET", 404),
        ("/timeline?span=1y", "GET", 400),
        ("/api/history?limit=-1", "GET", 400),
        ("/control", "POST", 403),  # (read-only: no control)
    ):
        status, headers, text = web.request(path, method=method)
        assert status == expected, (path, method, status, text)
        assert "Traceback" not in text and len(text) < 300, text
        assert "'none'" in headers["Content-Security-Policy"]
    for request in (b"GET /a b HTTP/1.1\r\n\r\n", b"\x00\xff garbage\r\n\r\n", b"GET / HTTP/1.1\r\nX: " + b"y" * 20000):
        with socket.create_connection((web.host, web.port), timeout=30) as raw:
            raw.sendall(request)
            assert raw.recv(100).startswith(b"HTTP/1.1 400 ")
    # a name that is not loopback's: another site's page that points a name of its own at 127.0.0.1
    status, _, text = web.request("/", headers={"Host": "attacker.example"})
    assert status == 403 and "loopback" in text
    assert web.proc.poll() is None
    assert '"paused":true' not in web.get("/api/status")  # (the refused POST changed nothing)


@pytest.mark.sqlite_only  # (who may open the page: the store is not asked)
def test_an_address_off_loopback_needs_a_token_and_every_request_then_carries_it(tmp_path):
    db = str(tmp_path / "jobs.db")
    app = subprocess.Popen([sys.executable, APP, db], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        wait_until(lambda: "tick" in declared(db), what="the app's jobs")
        refused = anarchon("--db", db, "web", "--listen", "0.0.0.0:0")
        assert refused.returncode == 2 and refused.stdout == ""
        assert refused.stderr.count("\n") == 1 and "needs a token" in refused.stderr, refused.stderr
        assert "needs a token" in anarchon("--db", db, "web", "--control").stderr
        page = Web(db, "--control", env={"ANARCHON_WEB_TOKEN": TOKEN})
        try:
            status, _, text = page.request("/")
            assert status == 401 and "token" in text
            assert page.request("/api/status", headers={"Authorization": "Bearer wrong-token-0123456789"})[0] == 401
            assert page.request("/api/status", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
            status, headers, _ = page.request(f"/job/tick?token={TOKEN}")
            assert status == 303 and headers["Location"] == "/job/tick"  # (the token leaves the address)
            cookie = headers["Set-Cookie"].split(";")[0]
            assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
            assert TOKEN not in cookie  # (a session made of it: the token is not sent to the host's other ports)
            assert page.request("/job/tick", headers={"Cookie": cookie})[0] == 200
            assert page.request("/job/tick", headers={"Cookie": f"anarchon_session={TOKEN}"})[0] == 401
            # what follows ``?token=`` goes back as the page's own path: no header, no other site
            for path in ("/%0d%0aSet-Cookie:%20evil=1", "/%2F%2Fevil.example/", "/job/%C3%A9"):
                status, headers, _ = page.request(f"{path}?token={TOKEN}")
                assert status == 303 and "evil=1" not in headers.get("Set-Cookie", ""), headers
                assert headers["Location"].startswith("/") and not headers["Location"].startswith("//")
                assert headers["Location"].isascii() and "\n" not in headers["Location"]
        finally:
            page.close()
    finally:
        stop_processes([app])


def paused(store, job):
    return {j["name"]: j for j in status_jobs(store)}[job]["paused"]


def test_control_needs_the_token_and_the_forms_token_and_is_logged(app):
    page = Web(app, "--control", env={"ANARCHON_WEB_TOKEN": TOKEN})
    try:
        session = page.request(f"/?token={TOKEN}")[1]["Set-Cookie"].split(";")[0]
        form = {"Cookie": session, "Content-Type": "application/x-www-form-urlencoded"}
        text = page.get("/job/tick", headers=form)
        csrf = re.search(r'name=csrf value="([0-9a-f]+)"', text).group(1)

        def post(job, action, csrf=csrf, headers=form):
            return page.request("/control", "POST", body=urllib.parse.urlencode(locals()), headers=headers)

        assert post("tick", "pause", csrf="0")[0] == 403
        assert post("tick", "pause", headers={})[0] == 401  # (no token)
        assert post("tick", "explode")[0] == 400
        assert post("nope", "pause")[0] == 404
        assert not paused(app, "tick")
        status, headers, _ = post("tick", "pause")
        assert status == 303 and headers["Location"] == "/job/tick"
        assert paused(app, "tick")
        status, headers, _ = post("..", "pause")  # (a name no path can carry: its page is ?name=)
        assert status == 303 and headers["Location"] == "/job?name=..", headers
        assert paused(app, "..")
        assert post("work", "trigger")[0] == 303
        wait_until(lambda: history(app, "work"), what="the triggered run")
    finally:
        page.close()
    assert "status page: pause 'tick', asked from 127.0.0.1" in page.log
    assert "'nope'" not in page.log  # (what was refused is not said to have been done)


def test_every_job_has_its_page_whatever_its_name(web):
    jobs = web.get("/")
    links = {
        html.unescape(name): html.unescape(href)
        for name, href in re.findall(r'<tr data-job="([^"]*)"><td><a href="([^"]*)">', jobs)
    }
    assert set(links) == JOBS
    for name in ODD:
        text = web.get(links[name])
        assert f"<h2>{html.escape(name)}</h2>" in text, (name, links[name])


def test_pages_that_leave_free_their_connections_and_new_ones_are_told_at_once(store):
    """On a store where nothing happens: ten pages that start listening together are each told
    what runs (a first look for all of them), and once they leave, their connections are closed."""

    from conftest import QUIET, run

    from anarchon_lite import Scheduler

    async def declare():
        scheduler = Scheduler(store)
        scheduler.every("quiet", "24h", lambda ctx: None, offset=QUIET)
        async with scheduler:
            pass

    run(declare())
    page = Web(store)
    try:
        before = len(os.listdir(f"/proc/{page.proc.pid}/fd"))
        pages = [socket.create_connection((page.host, page.port), timeout=30) for _ in range(10)]
        for one in pages:
            one.sendall(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        for one in pages:
            told = b""
            while b"data: " not in told:
                more = one.recv(65536)
                assert more, f"the stream ended without an event: {told!r}"
                told += more
        for one in pages:
            one.close()
        wait_until(lambda: len(os.listdir(f"/proc/{page.proc.pid}/fd")) <= before, what="the connections closed")
    finally:
        page.close()


def test_a_password_in_the_url_never_shows(pg_server, tmp_path):
    url = pg_server.url(schema=f"w{os.getpid()}")
    parts = urllib.parse.urlsplit(url)
    secret = urllib.parse.urlunsplit(
        parts._replace(netloc=f"{parts.username}:hunter2secret@{parts.hostname}:{parts.port}")
    )
    app = subprocess.Popen([sys.executable, APP, secret], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        wait_until(lambda: "tick" in declared(url), what="the app's jobs")
        page = Web(secret)
        try:
            assert "hunter2secret" not in page.get("/") and "***" in page.get("/")
            assert all("hunter2secret" not in page.get(path) for path in ("/timeline", "/running", "/api/status"))
        finally:
            page.close()
    finally:
        stop_processes([app])


# -- in a browser -------------------------------------------------------------------------------

# CI sets this: there, a browser that cannot be had fails the browser tests instead of skipping them.
REQUIRE_BROWSER = "ANARCHON_REQUIRE_BROWSER"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def browser_missing():
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"no {path} (Debian's chromium and chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "no selenium (pip install '.[test]')"
    return None


@pytest.fixture(scope="session")
def browser():
    """Headless Chromium, driven by selenium; quit (with every process it started) at the end."""
    reason = browser_missing()
    if reason is not None:
        if os.environ.get(REQUIRE_BROWSER):
            pytest.fail(f"a browser is required (${REQUIRE_BROWSER}) but cannot be had: {reason}")
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1300,900"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def shoot(browser, name):
    """A screenshot of the page, kept where ``$ANARCHON_SCREENSHOTS`` says (docs/ has them)."""
    folder = os.environ.get("ANARCHON_SCREENSHOTS")
    if folder:
        browser.save_screenshot(os.path.join(folder, f"status-page-{name}.png"))


def text_of(browser, selector):
    """The text of the first element ``selector`` finds now ("" while the page is being replaced)."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return browser.find_element(By.CSS_SELECTOR, selector).text
    except (NoSuchElementException, StaleElementReferenceException):
        return ""


def progress_of(browser, job):
    """The value of ``job``'s progress bar on the page now (None while it shows none)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        bars = browser.find_elements(By.CSS_SELECTOR, f"tr[data-run^='{job}/'] progress")
        return float(bars[0].get_attribute("value")) if bars else None
    except StaleElementReferenceException:  # (the rows are made anew at each change)
        return None


def test_in_a_browser_jobs_a_live_run_its_progress_an_error_and_markup_that_stays_text(browser, web, app):
    from selenium.webdriver.common.by import By

    cli(app, "trigger", "evil")
    # (tick's first run as well: its row shows the time of its last run, "-" until one)
    wait_until(lambda: ended(app, "evil") and ended(app, "tick"), what="the evil run's and a tick's end")
    browser.get(web.url)
    names = {row.get_attribute("data-job") for row in browser.find_elements(By.CSS_SELECTOR, "tr[data-job]")}
    assert names == JOBS
    stamp = browser.find_element(By.CSS_SELECTOR, "tr[data-job='tick'] td.at time")
    assert stamp.get_attribute("title").endswith("UTC")  # (shown in the viewer's zone, UTC on hover)
    shoot(browser, "jobs")

    # a run started after the page loaded appears, and its progress bar moves, without a reload
    browser.get(web.url + "running")
    wait_until(lambda: text_of(browser, "#live") == "live", what="the page listening")
    cli(app, "trigger", "work")
    first = wait_until(lambda: progress_of(browser, "work"), what="the work run's progress bar")
    wait_until(lambda: (progress_of(browser, "work") or 0) > first, what="the progress bar moving")
    shoot(browser, "running")

    # a failed run's error, arrived live, shows as the text it is
    browser.get(web.url + "job/fail")
    wait_until(lambda: text_of(browser, "#live") == "live", what="the page listening")
    cli(app, "trigger", "fail")
    error = "the disk <b>is</b> full"
    wait_until(lambda: error in text_of(browser, "#recent"), what="the failed run's error")
    assert browser.find_elements(By.CSS_SELECTOR, "#recent b") == []
    shoot(browser, "job")

    # a handler's output that is markup: text on the page, no script of it runs
    browser.get(web.url + "job/evil")
    output = browser.find_element(By.CSS_SELECTOR, "#recent details pre").get_attribute("textContent")
    assert output.startswith(EVIL)
    assert browser.title == "evil · anarchon_lite"
    assert browser.find_elements(By.CSS_SELECTOR, "#recent script, #recent img") == []

    browser.get(web.url + "timeline")
    script = "return Array.from(document.querySelectorAll('#timeline rect title'), t => t.textContent)"
    assert any(bar.startswith("tick:") for bar in browser.execute_script(script))  # (read at once: it is redrawn live)
    shoot(browser, "timeline")
    assert browser.title == "timeline · anarchon_lite"


@pytest.mark.sqlite_only  # (who may press a button: the token is the page's, not the store's)
def test_in_a_browser_control_needs_the_token(browser, app):
    from selenium.webdriver.common.by import By

    browser.delete_all_cookies()
    page = Web(app, "--control", env={"ANARCHON_WEB_TOKEN": TOKEN})
    try:
        browser.get(page.url + "job/tick")
        assert "needs its token" in browser.find_element(By.TAG_NAME, "body").text
        assert browser.find_elements(By.TAG_NAME, "button") == []
        browser.get(page.url + f"job/tick?token={TOKEN}")
        assert browser.current_url == page.url + "job/tick"  # (the token went into a cookie)
        shoot(browser, "control")
        next(b for b in browser.find_elements(By.TAG_NAME, "button") if b.text == "pause").click()
        wait_until(lambda: "paused" in text_of(browser, "table"), what="the job paused")  # (after the form's answer)
        assert paused(app, "tick")
    finally:
        browser.delete_all_cookies()
        page.close()
    assert "status page: pause 'tick', asked from 127.0.0.1" in page.log


def test_the_page_lives_in_a_running_scheduler_as_well(store):
    """``StatusPage`` on the event loop of a running scheduler: its pages, and its live events."""
    import asyncio

    from conftest import QUIET, run, wait_for

    from anarchon_lite import Scheduler, StatusPage

    def fetch(url):
        parts = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        try:
            conn.request("GET", parts.path)
            reply = conn.getresponse()
            if reply.getheader("Content-Type") == "text/event-stream":
                told = b""
                while b"data: " not in told or not told.endswith(b"\n\n"):
                    told += reply.read1(65536)
                return told.decode()
            return reply.read().decode()
        finally:
            conn.close()

    async def main():
        scheduler = Scheduler(store)
        scheduler.every("hello", "24h", lambda ctx: "hi <there>", offset=QUIET)
        loop = asyncio.get_running_loop()
        async with scheduler:
            await scheduler.trigger("hello")
            await wait_for(lambda: ended_in(scheduler), message="the triggered run's end")
            async with StatusPage(scheduler, "127.0.0.1:0") as page:
                text = await loop.run_in_executor(None, fetch, page.url + "job/hello")
                assert "succeeded" in text and "hi &lt;there&gt;" in text
                told = await loop.run_in_executor(None, fetch, page.url + "events")
                event = json.loads(told.split("data: ", 1)[1].split("\n\n")[0])
                assert [(r["job"], r["status"], r["output"]) for r in event["recent"]] == [
                    ("hello", "succeeded", "hi <there>")
                ]

    async def ended_in(scheduler):
        return [r for r in await scheduler.history("hello") if r.status == "succeeded"]

    run(main())


def test_the_jobs_page_shows_when_a_jittered_occurrence_starts(store):
    """NEXT on the jobs page is the next start, its jitter included, as ``status`` shows it."""
    import asyncio

    from conftest import run

    from anarchon_lite import Scheduler, StatusPage

    def fetch(url):
        parts = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        try:
            conn.request("GET", parts.path)
            return conn.getresponse().read().decode()
        finally:
            conn.close()

    async def main():
        scheduler = Scheduler(store)
        scheduler.cron("nightly", "0 3 * * *", lambda ctx: None, tz="UTC", jitter="30m")
        (job,) = await scheduler.status()
        assert job.next_start > job.next_at  # (this name's delay at this slot is not zero)
        async with StatusPage(scheduler, "127.0.0.1:0") as page:
            text = await asyncio.get_running_loop().run_in_executor(None, fetch, page.url)
        assert f'<time datetime="{job.next_start.isoformat()}">' in text
        assert "cron 0 3 * * * UTC jitter 30m" in text

    run(main())
