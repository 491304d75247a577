"""The README and docs/: contents that match the sections, links that lead somewhere, the hello
world that runs as shown, and every shell command shown run by a test or by .ci/run."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import stop_processes

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Each shell command the documents show, and what runs it (a test, or .ci/run).
INSTALL = "tests/test_readme.py::test_the_install_commands_shown_install_the_library_and_its_command"
COMMANDS = {
    "python3 -m venv .venv && . .venv/bin/activate && pip install -q . && python examples/export.py demo": (
        "tests/test_recipe.py::test_the_demo_hands_the_export_over_and_exports_each_customer_once"
    ),
    "python3 -m venv .venv && . .venv/bin/activate && pip install -q '.[test]' && python -m pytest -q": ".ci/run",
    "pip install .": INSTALL,
    "pip install '.[postgres]'": INSTALL,
    "pip wheel --no-deps -w dist .": INSTALL,
    "pip install dist/anarchon_lite-*.whl": INSTALL,
    "sudo python3 -m venv /opt/anarchon && sudo /opt/anarchon/bin/pip install .": INSTALL,
    "anarchon-lite crontab --check /etc/anarchon/crontab": "tests/test_readme.py::test_the_crontab_shown_checks_and_runs",
    "anarchon-lite --db /var/lib/anarchon/jobs.db crontab /etc/anarchon/crontab": (
        "tests/test_readme.py::test_the_crontab_shown_checks_and_runs"
    ),
    "python examples/hello.py": "tests/test_readme.py::test_the_hello_world_runs_each_occurrence_once_in_two_processes",
    "anarchon-lite --db postgresql://app@db.internal/app status": (
        "tests/test_postgres.py::test_the_command_line_works_on_a_url"
    ),
}


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose(path: Path) -> str:
    """The document without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)


def headings(path: Path) -> list[str]:
    """The document's sections (``## ``), as its Contents lists them."""
    return [line[3:] for line in prose(path).splitlines() if line.startswith("## ")]


def anchors(path: Path) -> set[str]:
    """The anchors of every heading of the document, subsections (``### ``) included."""
    return {anchor(line.lstrip("#")) for line in prose(path).splitlines() if re.match(r"#{1,6} ", line)}


def code_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), flags=re.DOTALL | re.MULTILINE)


def test_the_contents_list_every_section_in_order():
    readme = ROOT / "README.md"
    listed = re.findall(
        r"^- \[([^\]]+)\]\(#([^)]+)\)$", prose(readme).split("## Contents", 1)[1].split("\n## ")[0], re.MULTILINE
    )
    sections = [h for h in headings(readme) if h != "Contents"]
    assert [title for title, _ in listed] == sections
    assert [target for _, target in listed] == [anchor(h) for h in sections]


def test_the_readme_reads_top_down_in_ten_minutes():
    """The README stays short enough to read whole (reference material goes to docs/), and its
    Install section comes before anything that needs the command."""
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 400
    sections = headings(readme)
    assert sections.index("Install") < sections.index("Hello, world") < sections.index("Replacing cron")
    text = prose(readme)
    assert text.index("### The crontab file") < text.index("### Under systemd")


def test_every_link_leads_to_a_file_and_section_in_the_repository():
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(path)):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, section = target.partition("#")
            where = (path.parent / file).resolve() if file else path
            if not where.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif section and section not in anchors(where):
                broken.append(f"{path.name}: {target} (no such section)")
    assert broken == []


def test_every_shell_command_shown_is_one_a_test_or_ci_runs():
    shown = []
    for path in DOCS:
        for block in code_blocks(path, "sh"):
            shown += [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    assert sorted(set(shown) - set(COMMANDS)) == []
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in ci


# (SQLite only: the hello world as the README shows it, on a file)
def test_the_hello_world_runs_each_occurrence_once_in_two_processes(tmp_path):
    """The README shows examples/hello.py whole; two copies of it print each occurrence once."""
    source = (ROOT / "examples" / "hello.py").read_text()
    assert source.rstrip("\n") in code_blocks(ROOT / "README.md", "python")[0]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    logs = [tmp_path / f"hello-{n}.log" for n in range(2)]
    procs = []
    try:
        for log in logs:
            with open(log, "w") as out:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(ROOT / "examples" / "hello.py")], cwd=tmp_path, stdout=out, env=env
                    )
                )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            lines = [line for log in logs for line in log.read_text().splitlines() if line.startswith("hello from")]
            if len(lines) >= 4:
                break
            time.sleep(0.1)
        assert len(lines) >= 4, lines
    finally:
        stop_processes(procs, signal.SIGINT)
    lines = [line for log in logs for line in log.read_text().splitlines() if line.startswith("hello from")]
    occurrences = [line.rsplit(" ", 1)[-1] for line in lines]
    assert len(occurrences) == len(set(occurrences)), lines
    assert all(proc.returncode == 0 for proc in procs)


# (SQLite only: the crontab as the README shows it, on a file)
def test_the_crontab_shown_checks_and_runs(tmp_path):
    """The README's crontab (the "After" one) passes --check with both entries, and a crontab
    process runs it on a file of its own (joined, both jobs registered) and stops cleanly."""
    import json

    readme = (ROOT / "README.md").read_text()
    after = readme.split("After (the same file", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
    crontab = tmp_path / "crontab"
    crontab.write_text(after)
    command = [sys.executable, "-m", "anarchon_lite"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    checked = subprocess.run(
        [*command, "crontab", "--check", str(crontab)], capture_output=True, text=True, env=env, check=False
    )
    assert checked.returncode == 0 and "2 entries, no errors" in checked.stdout, checked.stderr
    db = str(tmp_path / "jobs.db")
    with open(tmp_path / "crontab.log", "w") as log:
        proc = subprocess.Popen([*command, "--db", db, "crontab", str(crontab)], stdout=log, stderr=log, env=env)
    try:
        deadline, names = time.monotonic() + 30, []
        while time.monotonic() < deadline and names != ["backup", "sync-orders"]:
            time.sleep(0.1)
            done = subprocess.run(
                [*command, "--db", db, "status", "--json"], capture_output=True, text=True, env=env, check=False
            )
            if done.returncode == 0:
                status = json.loads(done.stdout)
                names = [job["name"] for job in status["jobs"]] if status["processes"] else []
        assert names == ["backup", "sync-orders"]
    finally:
        stop_processes([proc])
    assert proc.returncode == 0, (tmp_path / "crontab.log").read_text()


def test_the_install_commands_shown_install_the_library_and_its_command(tmp_path):
    """The README's Install section, run as shown in a copy of the checkout: ``pip install .`` puts
    the library and ``anarchon-lite`` in the active environment's bin/, ``'.[postgres]'`` adds
    psycopg, a wheel built with ``pip wheel`` installs as well into another environment, and the
    service's environment at /opt/anarchon (here under tmp_path, without sudo) holds the command
    the systemd unit names."""
    import shutil

    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    blocks = [
        [line.split("  #")[0].strip() for line in b.splitlines() if line.strip()]
        for b in re.findall(r"^```sh\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE)
    ]
    assert blocks == [
        [
            "pip install .",
            "pip install '.[postgres]'",
            "pip wheel --no-deps -w dist .",
            "pip install dist/anarchon_lite-*.whl",
        ],
        ["sudo python3 -m venv /opt/anarchon && sudo /opt/anarchon/bin/pip install ."],
    ]
    assert "ExecStart=/opt/anarchon/bin/anarchon-lite " in readme
    checkout = tmp_path / "checkout"  # (a copy: building in the checkout would leave build/ and egg-info there)
    checkout.mkdir()
    for name in ("pyproject.toml", "anarchon_lite.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, checkout / name)
    shutil.copytree(ROOT / "wheel", checkout / "wheel", symlinks=True)
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}

    def venv(where: Path) -> dict[str, str]:
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
        return {**base, "VIRTUAL_ENV": str(where), "PATH": f"{where / 'bin'}{os.pathsep}{base.get('PATH', '')}"}

    def shell(command: str, env: dict[str, str]) -> None:
        done = subprocess.run(
            ["bash", "-c", command], check=False, cwd=checkout, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, (command, done.stdout, done.stderr)

    def works(command: Path, *code: str) -> None:
        version = subprocess.run(
            [str(command), "--version"], check=False, capture_output=True, text=True, env=base, cwd=tmp_path
        )
        assert version.returncode == 0 and version.stdout.startswith("anarchon-lite "), version.stderr
        for line in code:
            python = command.parent / "python"
            subprocess.run([str(python), "-c", line], check=True, env=base, cwd=tmp_path)

    library, wheel, service = tmp_path / "venv", tmp_path / "elsewhere", tmp_path / "opt" / "anarchon"
    here = venv(library)
    shell(blocks[0][0], here)
    works(library / "bin" / "anarchon-lite", "import anarchon_lite, dateutil")
    shell(blocks[0][1], here)
    works(library / "bin" / "anarchon-lite", "import psycopg")
    there = venv(wheel)
    shell(blocks[0][2], there)
    assert [p.name for p in (checkout / "dist").glob("anarchon_lite-*.whl")], list((checkout / "dist").iterdir())
    shell(blocks[0][3], there)
    works(
        wheel / "bin" / "anarchon-lite",
        "import anarchon_lite; assert 'site-packages' in anarchon_lite.__file__",
    )
    shell(blocks[1][0].replace("sudo ", "").replace("/opt/anarchon", str(service)), base)
    works(service / "bin" / "anarchon-lite")
