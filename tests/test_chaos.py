"""The chaos run of ``tests/chaos.py``, with a fixed seed, on each store (``python tests/chaos.py
--minutes 10 [--store postgresql]`` runs a long one)."""

import chaos


def test_chaos_45_seconds(tmp_path, machine_to_itself):
    report = chaos.run(str(tmp_path), seconds=45, seed=20261129, processes=3)
    judge(report, occurrences=30)


def test_chaos_on_postgresql_30_seconds(tmp_path, pg_server, machine_to_itself):
    """On the session's server, which one kind of fault restarts (unless it was given)."""
    report = chaos.run(str(tmp_path), seconds=30, seed=20261201, processes=3, store="postgresql", server=pg_server)
    judge(report, occurrences=20)


def judge(report, occurrences):
    summary = chaos.describe(report)
    print(summary)
    assert report["violations"] == [], summary
    assert all(count > 0 for count in report["faults"].values()), summary  # every kind of fault happened
    assert report["aimed_kills_that_hit"] > 0, summary
    assert report["resumed"] > 0 and report["interrupted"] > 0, summary
    assert report["succeeded"] == report["occurrences"] > occurrences, summary
