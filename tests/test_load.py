"""The load run of ``tests/load.py``, shortened (``python tests/load.py`` runs the full minute)."""

import load


def test_fifty_jobs_every_100_ms_across_four_processes(tmp_path, machine_to_itself):
    report = load.run(str(tmp_path), seconds=20, jobs=50, processes=4)
    summary = load.describe(report)
    print(summary)
    assert report["problems"] == [], summary
    assert report["occurrences_judged"] >= 50 * 10 * 15, summary  # 17 s judged, at 10 per second, per job
    assert report["statuses"]["succeeded"] > report["occurrences_judged"] // 2, summary
    assert report["heartbeats"]["renewals"] > 4 * 20, summary  # the long jobs were renewed throughout
