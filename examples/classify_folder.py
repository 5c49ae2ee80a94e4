"""Classify every text file of a folder through one batch, and write a CSV of file and label.

    python examples/classify_folder.py examples/documents --labels invoice,contract,support,other \
        --out out/labels.csv

It writes one OpenAI batch line per file, uploads them with the Files API, creates a batch,
waits for it and reads the output file: the path a pipeline of millions of documents takes.
Each answer is constrained to one of the labels (vLLM's `structured_outputs.choice`), so the
CSV holds only labels, whatever the model would have rambled.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import time
from pathlib import Path

from openai import OpenAI

PROMPT = "Classify this document as one of: {labels}.\n\n{text}"


def batch_lines(folder: Path, labels: list[str], model: str) -> tuple[str, dict[str, str]]:
    """The batch input (JSONL) and each custom_id's file name."""
    lines, names = [], {}
    for number, path in enumerate(sorted(folder.glob("*.txt"))):
        custom_id = f"doc-{number}"
        names[custom_id] = path.name
        body = {"model": model, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": PROMPT.format(labels=", ".join(labels),
                                                                        text=path.read_text())}],
                "structured_outputs": {"choice": labels}}
        lines.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))
    return "\n".join(lines) + "\n", names


def run_batch(client: OpenAI, jsonl: str) -> list[dict]:
    """Upload, create, wait; the output file's lines."""
    upload = client.files.create(file=("classify.jsonl", jsonl.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
    if batch.status != "completed":
        sys.exit(f"batch {batch.id} ended {batch.status}: {batch.errors}")
    files = [batch.output_file_id, batch.error_file_id]  # the requests that failed are in the error file
    text = "".join(client.files.content(file_id).text for file_id in files if file_id)
    return [json.loads(line) for line in io.StringIO(text) if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--labels", default="invoice,contract,support,other")
    parser.add_argument("--out", type=Path, default=Path("labels.csv"))
    parser.add_argument("--model", default="demo")
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    args = parser.parse_args()
    labels = args.labels.split(",")
    jsonl, names = batch_lines(args.folder, labels, args.model)
    results = run_batch(OpenAI(base_url=args.base_url, api_key=args.api_key), jsonl)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["file", "label", "error"])
        for result in sorted(results, key=lambda result: names[result["custom_id"]]):
            if result["error"]:
                writer.writerow([names[result["custom_id"]], "", result["error"]["message"]])
            else:
                answer = result["response"]["body"]["choices"][0]["message"]["content"]
                writer.writerow([names[result["custom_id"]], answer, ""])
    print(f"{len(results)} documents classified into {args.out}")


if __name__ == "__main__":
    main()
