"""Run the engine over a JSONL file of prompts, no queue involved.

    python -m engine MODEL_DIR prompts.jsonl [--max-tokens DEFAULT] [--temperature T] [--num-kv-blocks N]

Each line is a short form {"custom_id"?, "prompt"} or an OpenAI batch line whose
body has "prompt" or "messages". Prints one JSON object per completion.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine import LLM, SamplingParams


def read_prompts(path: str, tokenizer, default_max_tokens: int):
    """(custom_ids, prompts as text or token ids, per-line max_tokens)"""
    custom_ids, prompts, max_tokens = [], [], []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            body = record.get("body", record)
            if "messages" in body:
                # Token ids straight from the template, so the BOS it writes is not doubled.
                prompt = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)
            elif isinstance(body.get("prompt"), str):
                prompt = body["prompt"]
            else:
                sys.exit(f"{path}:{line_number}: prompt: a string 'prompt' or a 'messages' list is required")
            custom_ids.append(record.get("custom_id", f"line-{line_number}"))
            prompts.append(prompt)
            max_tokens.append(body.get("max_tokens", default_max_tokens))
    return custom_ids, prompts, max_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description="Generate completions for a JSONL file of prompts.")
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
        custom_ids, prompts, max_tokens = read_prompts(args.prompts, llm.get_tokenizer(), args.max_tokens)
        params = [SamplingParams(temperature=args.temperature, max_tokens=n) for n in max_tokens]
        outputs = llm.generate(prompts, params)
    except ValueError as error:
        sys.exit(f"error: {error}")
    for custom_id, output in zip(custom_ids, outputs):
        print(json.dumps({"custom_id": custom_id, "text": output.text, "finish_reason": output.finish_reason,
                          "prompt_tokens": len(output.prompt_token_ids), "completion_tokens": len(output.token_ids)}))


if __name__ == "__main__":
    main()
