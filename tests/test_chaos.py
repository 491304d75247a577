"""The chaos run of ``tests/chaos.py``, 45 s with a fixed seed (``python tests/chaos.py --minutes 10``
runs a long one)."""

import chaos


def test_chaos_45_seconds(tmp_path, machine_to_itself):
    report = chaos.run(str(tmp_path), seconds=45, seed=20261129, processes=3)
    summary = chaos.describe(report)
    print(summary)
    assert report["violations"] == [], summary
    assert all(count > 0 for count in report["faults"].values()), summary  # every kind of fault happened
    assert report["aimed_kills_that_hit"] > 0, summary
    assert report["resumed"] > 0 and report["interrupted"] > 0, summary
    assert report["succeeded"] == report["occurrences"] > 30, summary
