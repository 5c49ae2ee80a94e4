"""benchmarks/common.py's child_result: what every benchmark reads back from a peer process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.common import child_result


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_peer_result_is_its_last_marked_line_among_its_logs():
    done = python("print('KVFLEET_RESULT {\"seconds\": 1}'); print('INFO a log line'); "
                  "print('KVFLEET_RESULT {\"seconds\": 2.5}'); print('INFO exiting')")
    assert child_result(done, "vLLM peer") == {"seconds": 2.5}


def test_a_peer_that_fails_or_reports_nothing_is_named_with_the_end_of_its_output():
    failed = python("import sys; print('KVFLEET_RESULT {}'); sys.exit('CUDA out of memory')")
    with pytest.raises(RuntimeError, match=r"vLLM peer failed \(exit 1\):\nCUDA out of memory"):
        child_result(failed, "vLLM peer")
    silent = python("print('loaded the model')")
    with pytest.raises(RuntimeError, match=r"kvfleet child failed \(exit 0\):\nloaded the model"):
        child_result(silent, "kvfleet child")
