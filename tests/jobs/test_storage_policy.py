"""Which destinations a batch may write to: KVFLEET_ALLOWED_OUTPUTS, matched by whole segments."""

from __future__ import annotations

import pytest

from jobs.storage import allowed_outputs, check_output_allowed


@pytest.mark.parametrize("sink, allowed, is_allowed", [
    ("redis", ["redis"], True),
    ("redis", ["s3://b/"], False),
    ("s3://b/team/x", ["s3://b/team/"], True),
    ("s3://b/team", ["s3://b/team/"], True),
    ("s3://b/team-other", ["s3://b/team/"], False),
    ("s3://b/team/x", ["s3://b"], True),
    ("s3://c/team/x", ["s3://b"], False),
    ("file:///srv/results/a", ["file:///srv/results/"], True),
    ("file:///srv/results-x", ["file:///srv/results"], False),
    ("file:///srv", ["file:///srv/results/"], False),
    ("file:///anything", ["file:///"], True),
    ("s3://srv/results/a", ["file:///srv/results/"], False),
])
def test_prefixes_match_whole_segments(sink, allowed, is_allowed):
    if is_allowed:
        assert check_output_allowed(sink, allowed) == sink.rstrip("/")
    else:
        with pytest.raises(ValueError, match="is not an allowed destination"):
            check_output_allowed(sink, allowed)


def test_dot_dot_never_passes():
    with pytest.raises(ValueError, match="'..' is not accepted"):
        check_output_allowed("file:///srv/results/../etc", ["file:///srv/results/"])
    with pytest.raises(ValueError, match="'..' is not accepted"):
        check_output_allowed("s3://b/team/../other", ["s3://b/team/"])


def test_the_default_allows_only_the_default_output():
    assert allowed_outputs({}) == ["redis"]
    assert allowed_outputs({"KVFLEET_DEFAULT_OUTPUT": "s3://results/batches/"}) == ["s3://results/batches"]
    assert allowed_outputs({"KVFLEET_ALLOWED_OUTPUTS": "redis, s3://b/p/ ,", "KVFLEET_DEFAULT_OUTPUT": "x"}) == [
        "redis", "s3://b/p"]
    with pytest.raises(ValueError, match="output: expected"):
        allowed_outputs({"KVFLEET_ALLOWED_OUTPUTS": "ftp://x"})
