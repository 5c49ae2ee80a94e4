"""Every block the README and the guides mark runnable runs against the fleet its page starts,
and the scripts of examples/ are checked on the same fleet (tests/docs/example_checks.py)."""

from __future__ import annotations

import pytest

from tests.docs.example_checks import CHECKS
from tests.docs.fleets import DOC_PATHS, blocks, failure, fleet_of, run_block, started

RUNNABLE = [block for doc in DOC_PATHS for block in blocks(doc) if block.kind == "runnable"]
FLEETS = sorted({fleet_of(doc) for doc in DOC_PATHS} - {None})
ALONE = [block for block in RUNNABLE if fleet_of(block.doc) is None]


def test_the_docs_mark_their_commands_runnable_and_name_their_fleets():
    pages = {block.doc.name for block in RUNNABLE}
    assert {"README.md", "batch.md", "online.md", "embeddings.md", "structured-outputs.md"} <= pages
    assert all(command.startswith("python -m workers.serve ") for command in FLEETS)
    assert set(FLEETS) == set(CHECKS), "every fleet the guides start has its examples checked, and only those"


@pytest.mark.parametrize("command", FLEETS)
def test_the_blocks_of_every_page_a_fleet_serves_run_and_its_examples_check_out(command, tmp_path):
    with started(command, tmp_path) as fleet:
        failures = []
        for block in (block for block in RUNNABLE if fleet_of(block.doc) == command):
            workdir = tmp_path / block.doc.stem  # one per page: its blocks share out/
            workdir.mkdir(exist_ok=True)
            failures.append(failure(block, run_block(block, fleet, workdir)))
        assert not any(failures), "\n\n".join(filter(None, failures))
        for check in CHECKS[command]:
            check(fleet, tmp_path)


@pytest.mark.parametrize("block", ALONE, ids=[block.name for block in ALONE])
def test_a_block_that_needs_no_fleet_runs(block, tmp_path):
    assert failure(block, run_block(block, None, tmp_path)) is None
