"""Every block the README and the guides mark runnable runs, against the fleet its page starts."""

from __future__ import annotations

import pytest

from tests.docs.fleets import DOC_PATHS, blocks, run_block

RUNNABLE = [block for doc in DOC_PATHS for block in blocks(doc) if block.kind == "runnable"]


def test_the_docs_mark_their_commands_runnable_and_name_their_fleets():
    pages = {block.doc.name for block in RUNNABLE}
    assert {"README.md", "batch.md", "online.md", "embeddings.md", "structured-outputs.md"} <= pages
    fleets = [block for doc in DOC_PATHS for block in blocks(doc) if block.kind == "fleet"]
    assert all(block.language == "bash" and block.code.startswith("python -m workers.serve ") for block in fleets)


@pytest.mark.parametrize("block", RUNNABLE, ids=[block.name for block in RUNNABLE])
def test_a_documented_block_runs(block, fleets, tmp_path_factory):
    workdir = tmp_path_factory.getbasetemp() / f"docs-{block.doc.stem}"  # one per page: its blocks share out/
    workdir.mkdir(exist_ok=True)
    done = run_block(block, fleets, workdir)
    assert done.returncode == 0, f"{block.name}:\n{block.code}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), f"{block.name} printed nothing"
