"""Stream a chat answer token by token, as an interactive app does.

    python examples/stream_chat.py "Why is the sky blue?"
    python examples/stream_chat.py          # a conversation: one question a line, Ctrl-D ends it
"""

from __future__ import annotations

import argparse
import os
import sys

from openai import OpenAI


def ask(client: OpenAI, args: argparse.Namespace, messages: list[dict]) -> str:
    """Print the answer as it streams; the whole answer."""
    parts = []
    stream = client.chat.completions.create(model=args.model, messages=messages, max_tokens=args.max_tokens,
                                            temperature=args.temperature, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            print(parts[-1], end="", flush=True)
        if chunk.usage:  # the last chunk, when include_usage is set
            print(f"\n[{chunk.usage.prompt_tokens} prompt tokens, {chunk.usage.completion_tokens} generated]")
    return "".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7, help="0: greedy, the same answer every time")
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    questions = [args.question] if args.question else sys.stdin
    messages: list[dict] = []
    for question in questions:
        messages.append({"role": "user", "content": question.strip()})
        messages.append({"role": "assistant", "content": ask(client, args, messages)})


if __name__ == "__main__":
    main()
