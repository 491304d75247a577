"""The wheel: a typed package that mypy --strict reads, and decorated handlers keep their types."""

import os

import pytest


def test_the_installed_wheel_is_typed_and_decorated_handlers_keep_their_types(tmp_path):
    """The wheel installs a typed package (py.typed), so mypy --strict on a user script sees the
    library's types: every/cron/rrule, as decorators and as calls, give the handler back with its
    type (overloads), and the names a user script needs are exported (not even
    --disallow-any-decorated finds anything). The script is checked against the wheel built from
    this checkout and installed, not against the source file."""
    pytest.importorskip("mypy")  # (not installable on Python 3.9: pyproject's test extra skips it there)
    import shutil
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    source = tmp_path / "source"  # (a copy: building in the checkout would leave build/ and egg-info there)
    source.mkdir()
    for name in ("pyproject.toml", "anarchon_lite.py", "README.md", "LICENSE"):
        shutil.copy(root / name, source / name)
    shutil.copytree(root / "wheel", source / "wheel", symlinks=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)], check=True)
    (wheel,) = tmp_path.glob("anarchon_lite-*.whl")
    assert "anarchon_lite/py.typed" in zipfile.ZipFile(wheel).namelist()
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    user = tmp_path / "user"
    user.mkdir()
    (user / "user.py").write_text(
        "import asyncio\n"
        "from anarchon_lite import Checkpoint, RunContext, Scheduler\n"
        "scheduler = Scheduler('jobs.db')\n\n"
        "@scheduler.every('export', '1h', timeout='50m')\n"
        "async def export(ctx: RunContext) -> int:\n"
        "    checkpoint: Checkpoint = ctx.checkpoint\n"
        "    await checkpoint.set(1)\n"
        "    return 1\n\n"
        "@scheduler.cron('backup', '0 3 * * *')\n"
        "def backup(ctx: RunContext) -> str:\n"
        "    return ctx.job\n\n"
        "def report(ctx: RunContext) -> None:\n"
        "    return None\n\n"
        "same = scheduler.rrule('report', 'FREQ=DAILY', report)\n"
        "count: int = asyncio.run(export(ctx=None))  # type: ignore[arg-type]\n"
        "name: str = backup(ctx=None)  # type: ignore[arg-type]\n"
        "scheduler.close()\n"
        "wrong: str = scheduler.instance + 1  # type: ignore[operator]\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--disallow-any-decorated", "--warn-unused-ignores", "user.py"],
        cwd=user,  # (no anarchon_lite.py beside it: mypy must find the installed package)
        env={**env, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    imported = subprocess.run(
        [sys.executable, "-c", "import anarchon_lite; print(anarchon_lite.__file__)"],
        cwd=user,
        env={**env, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert imported.stdout.strip() == str(site / "anarchon_lite" / "__init__.py")


def test_the_module_docstrings_example_names_everything_it_uses(monkeypatch, tmp_path):
    """``help(anarchon_lite)`` shows an example: run as shown (its two helpers are the reader's, and
    ``asyncio.run`` is stopped before the scheduler would run for ever), it needs nothing more."""
    import asyncio

    import anarchon_lite

    example = anarchon_lite.__doc__.split("::\n", 1)[1]
    started = []
    monkeypatch.setattr(asyncio, "run", lambda coroutine: started.append(coroutine.close()))
    monkeypatch.chdir(tmp_path)
    exec(compile(example.replace("\n    ", "\n"), "example", "exec"), {"batches_after": None, "export_batch": None})  # noqa: S102 - our own docstring
    assert started == [None]


def test_the_declaring_types_are_read_at_run_time_too():
    """``typing.get_type_hints`` (what documentation tools and validators call) reads the options
    and the declaring methods: ``Unpack`` is only for type checkers, and was missing at run time."""
    import sys
    import typing

    import anarchon_lite

    hints = typing.get_type_hints(anarchon_lite.JobOptions)
    assert {"timeout", "overlap", "jitter", "on_failure"} <= set(hints)
    if sys.version_info >= (3, 10):  # (3.9 cannot read the ``X | None`` of the rest of the file)
        for method in ("every", "cron", "at", "on_start"):  # (rrule's names dateutil, imported when used)
            assert "options" in typing.get_type_hints(getattr(anarchon_lite.Scheduler, method))
