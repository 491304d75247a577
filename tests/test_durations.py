import datetime as dt

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anarchon_lite import ConfigError, format_duration, parse_duration


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("500ms", 0.5),
        ("30s", 30),
        ("5m", 300),
        ("1h", 3600),
        ("1d", 86400),
        ("1h30m", 5400),
        ("2w", 1209600),
        ("1m 30s", 90),
        ("1.5s", 1.5),
        (" 10S ", 10),
    ],
)
def test_strings(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


def test_numbers_and_timedeltas():
    assert parse_duration(3) == 3.0
    assert parse_duration(0.25) == 0.25
    assert parse_duration(dt.timedelta(minutes=2)) == 120.0


@pytest.mark.parametrize(
    "bad", ["1x", "", "h", "10", "1h-", "abc", 0, -1, "0s", dt.timedelta(0), float("nan"), True, None, [1]]
)
def test_bad_durations_name_job_and_option(bad):
    with pytest.raises(ConfigError) as info:
        parse_duration(bad, job="export", option="timeout")
    assert info.value.job == "export" and info.value.option == "timeout"
    assert "export" in str(info.value) and "timeout" in str(info.value)


@given(st.integers(min_value=1, max_value=10**10))
def test_format_round_trips(ms):
    assert parse_duration(format_duration(ms / 1000)) == pytest.approx(ms / 1000)
