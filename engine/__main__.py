"""Run the engine over a JSONL file of prompts, no queue involved.

    python -m engine MODEL_DIR prompts.jsonl [--max-tokens DEFAULT] [--temperature T] [--num-kv-blocks N]

Lines are validated as `python -m producers.submit` validates them (jobs.schemas): a
short form {"custom_id"?, "prompt", sampling fields} or an OpenAI batch line for
/v1/completions or /v1/chat/completions. The whole file is read first: a malformed
line is reported as FILE:LINE: field: message and nothing runs (exit 1). A request
that can never fit the model or the KV pool gets its own error object; the others run.
Prints one JSON object per line, in input order.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine import LLM, ContextLengthExceeded, SamplingParams
from jobs.schemas import CHAT_COMPLETIONS, LineError, parse_line


def to_request(line: str, line_number: int, tokenizer, defaults: dict) -> tuple[str, object, dict]:
    """(custom_id, prompt as text or token ids, SamplingParams keyword arguments), or LineError."""
    request = parse_line(line, line_number)
    body = request.parsed_body()
    if request.url == CHAT_COMPLETIONS:
        try:  # token ids straight from the template, so the BOS it writes is not doubled
            prompt = tokenizer.apply_chat_template(body.template_messages(), add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
        except Exception as error:  # noqa: BLE001 (a template error is the line's fault)
            raise LineError(line_number, "messages", f"the chat template failed: {error}") from None
    else:
        prompt = body.prompt
    options = {**defaults, **body.sampling_kwargs()}
    try:  # cross-field checks (min_tokens <= max_tokens, ...) before anything runs
        SamplingParams(**options)
    except ValueError as error:
        raise LineError(line_number, "body", str(error)) from None
    return request.custom_id, prompt, options


def read_requests(path: str, tokenizer, defaults: dict) -> list[tuple[str, object, dict]]:
    requests, errors = [], []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    requests.append(to_request(line, line_number, tokenizer, defaults))
                except LineError as error:  # "LINE: field: message", as producers.submit prints it
                    errors.append(f"{path}:{error}")
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
