"""Embed a folder of text files and search it by meaning.

    python examples/embed_search.py examples/documents "When must the invoice be paid?" \
        --base-url http://127.0.0.1:8001/v1 --model demo-embedding

Each file is split into chunks of whole paragraphs; every chunk and the query are embedded through
`/v1/embeddings` (many inputs a request, as the API allows), and the chunks are ranked
by cosine similarity to the query. The vectors are normalized by the model (all-MiniLM's
sentence-transformers files say so), so cosine similarity is a dot product.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
from openai import OpenAI

MAX_INPUTS = 256  # inputs per request; the API takes up to 2,048


def chunks(folder: Path, max_chars: int = 800) -> list[tuple[str, str]]:
    """(file name, chunk) for every .txt file, in name order: its paragraphs joined while they
    fit in `max_chars` (about 200 tokens; all-MiniLM reads 256), so a short file is one chunk."""
    found = []
    for path in sorted(folder.glob("*.txt")):
        current = ""
        for paragraph in filter(None, (part.strip() for part in path.read_text().split("\n\n"))):
            if current and len(current) + len(paragraph) > max_chars:
                found.append((path.name, current))
                current = ""
            current = f"{current}\n\n{paragraph}" if current else paragraph
        if current:
            found.append((path.name, current))
    return found


def embed(client: OpenAI, model: str, texts: list[str]) -> np.ndarray:
    """[len(texts), dimensions] float32."""
    rows = []
    for start in range(0, len(texts), MAX_INPUTS):
        response = client.embeddings.create(model=model, input=texts[start:start + MAX_INPUTS])
        rows += [item.embedding for item in sorted(response.data, key=lambda item: item.index)]
    return np.asarray(rows, dtype=np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("query")
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--model", default="demo-embedding")
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8001/v1"))
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    passages = chunks(args.folder)
    vectors = embed(client, args.model, [text for _, text in passages])  # [passages, dimensions]
    query = embed(client, args.model, [args.query])[0]                   # [dimensions]
    scores = vectors @ query
    for index in np.argsort(-scores)[:args.top]:
        name, text = passages[index]
        print(f"{scores[index]:.3f}  {name}: {' '.join(text.split())[:100]}")


if __name__ == "__main__":
    main()
