"""Run the engine over a JSONL file of prompts, no queue involved.

    python -m engine MODEL_DIR prompts.jsonl [--max-tokens DEFAULT] [--temperature T] [--num-kv-blocks N]

Each line is a short form {"custom_id"?, "prompt", "max_tokens"?} or an OpenAI batch
line whose body has "prompt" or "messages". The whole file is read first: a malformed
line is reported as FILE:LINE: field: message and nothing runs (exit 1). A request
that can never fit the model or the KV pool gets its own error object; the others run.
Prints one JSON object per line, in input order.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine import LLM, ContextLengthExceeded, SamplingParams


class LineError(ValueError):
    def __init__(self, path: str, line_number: int, field: str, message: str) -> None:
        super().__init__(f"{path}:{line_number}: {field}: {message}")


def parse_line(path: str, line_number: int, line: str, tokenizer, defaults: dict) -> tuple[str, object, dict]:
    """(custom_id, prompt as text or token ids, SamplingParams keyword arguments)"""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise LineError(path, line_number, "line", f"not valid JSON ({error})") from None
    if not isinstance(record, dict):
        raise LineError(path, line_number, "line", "must be a JSON object")
    body = record.get("body", record)
    if not isinstance(body, dict):
        raise LineError(path, line_number, "body", "must be a JSON object")
    if isinstance(body.get("messages"), list):
        try:  # token ids straight from the template, so the BOS it writes is not doubled
            prompt = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
        except Exception as error:  # noqa: BLE001 (jinja and tokenizer errors alike)
            raise LineError(path, line_number, "messages", str(error)) from None
    elif isinstance(body.get("prompt"), str) and body["prompt"]:
        prompt = body["prompt"]
    else:
        raise LineError(path, line_number, "prompt", "a non-empty string 'prompt' or a 'messages' list is required")
    options = {**defaults, **{k: body[k] for k in ("max_tokens", "temperature") if k in body}}
    try:
        SamplingParams(**options)
    except (TypeError, ValueError) as error:
        field = next((k for k in ("max_tokens", "temperature") if k in str(error)), "body")
        raise LineError(path, line_number, field, str(error)) from None
    custom_id = record.get("custom_id", f"line-{line_number}")
    return str(custom_id), prompt, options


def read_requests(path: str, tokenizer, defaults: dict) -> list[tuple[str, object, dict]]:
    requests, errors = [], []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    requests.append(parse_line(path, line_number, line, tokenizer, defaults))
                except LineError as error:
                    errors.append(str(error))
    if errors:
        sys.exit("\n".join(errors[:20] + ([f"... and {len(errors) - 20} more"] if len(errors) > 20 else [])))
    return requests


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("prompts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton"])
    args = parser.parse_args()
    try:
        llm = LLM(args.model, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                  attention_backend=args.attention_backend)
    except ValueError as error:
        sys.exit(f"error: {error}")
    requests = read_requests(args.prompts, llm.get_tokenizer(),
                             {"max_tokens": args.max_tokens, "temperature": args.temperature})
    engine, lines = llm.engine, {}
    for index, (custom_id, prompt, options) in enumerate(requests):
        try:
            engine.add_request(str(index), prompt, SamplingParams(**options))
        except ValueError as error:  # e.g. can never fit: its own error, the rest still run
            code = "context_length_exceeded" if isinstance(error, ContextLengthExceeded) else "invalid_request"
            lines[index] = {"custom_id": custom_id, "error": {"code": code, "message": str(error)}}
    while engine.has_unfinished():
        for output in engine.step():
            index = int(output.request_id)
            lines[index] = {"custom_id": requests[index][0], "text": output.text,
                            "finish_reason": output.finish_reason, "prompt_tokens": len(output.prompt_token_ids),
                            "completion_tokens": len(output.token_ids)}
    for index in range(len(requests)):
        print(json.dumps(lines[index]))


if __name__ == "__main__":
    main()
