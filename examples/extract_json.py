"""Extract fields from documents as JSON that always matches a schema.

    python examples/extract_json.py examples/documents/invoice-*.txt --schema examples/invoice_schema.json

One chat request a document, with OpenAI's `response_format` of type `json_schema`: the worker
constrains the tokens to the schema (xgrammar), so every answer parses and validates, even from a
small model. It prints one JSON line a document: `{"file": ..., "fields": {...}}`. For a folder of
millions, put the same bodies in a batch (see classify_folder.py).
"""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI

INSTRUCTION = "Extract the invoice's fields from this document as JSON.\n\n"


def extract(client: OpenAI, model: str, schema: dict, path: Path) -> dict:
    response = client.chat.completions.create(
        model=model, temperature=0, max_tokens=256,
        messages=[{"role": "user", "content": INSTRUCTION + path.read_text()}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "fields", "schema": schema, "strict": True}})
    choice = response.choices[0]
    if choice.finish_reason != "stop":  # cut by max_tokens: the JSON is incomplete
        return {"file": path.name, "error": f"finish_reason {choice.finish_reason}"}
    return {"file": path.name, "fields": json.loads(choice.message.content)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--schema", type=Path, required=True)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    schema = json.loads(args.schema.read_text())
    with ThreadPoolExecutor(max_workers=8) as pool:  # online requests run side by side in the engine
        for line in pool.map(lambda path: extract(client, args.model, schema, path), args.files):
            print(json.dumps(line))


if __name__ == "__main__":
    main()
