"""Tiny thinking, tool-calling checkpoints for the reasoning and tool-call tests: a random Qwen3
and gpt-oss (tests/tiny_models.py) with their families' special tokens and the chat templates the
real checkpoints ship (from llama.cpp's tree, unpacked by `make install`:
scripts/chat_templates.py), and a sampler that makes a request's output say a given text, as a
trained model would (random weights never think or call a tool)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig

from engine.demo_model import build_tokenizer, write_checkpoint
from tests.tiny_models import TINY_CONFIGS, VOCAB

TEMPLATES = Path(os.environ.get("KVFLEET_CHAT_TEMPLATES",
                                Path(__file__).resolve().parents[1] / ".venv" / "share" / "chat-templates"))
QWEN3_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
QWEN3_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
HARMONY_SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
                   "<|endoftext|>"]


@dataclass(frozen=True)
class Family:
    architecture: str  # tests/tiny_models.py
    template: str  # a file of llama.cpp's models/templates
    special: list[str]  # special tokens: one token each, left out of decoded text unless kept
    added: list[str]  # added tokens that decode as text (Qwen's tags)
    eos: list[str]
    bos: str | None = None  # None: the tiny tokenizer's <s>


FAMILIES = {
    "qwen3": Family("qwen3", "Qwen-Qwen3-0.6B.jinja", QWEN3_SPECIAL, QWEN3_ADDED, ["<|im_end|>"]),
    "gpt_oss": Family("gpt_oss", "openai-gpt-oss-120b.jinja", HARMONY_SPECIAL, [], ["<|return|>", "<|call|>"]),
    "deepseek_r1": Family("qwen2", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
                          ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
                          ["<think>", "</think>"], ["<｜end▁of▁sentence｜>"], "<｜begin▁of▁sentence｜>"),
    "llama3": Family("llama", "meta-llama-Llama-3.1-8B-Instruct.jinja",
                     ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                      "<|python_tag|>"], [], ["<|eot_id|>", "<|eom_id|>"], "<|begin_of_text|>"),
    "mistral": Family("mistral", "mistralai-Mistral-Nemo-Instruct-2407.jinja",
                      ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                       "[/TOOL_RESULTS]"], [], ["</s>"]),
}


def chat_template(kind: str) -> str:
    path = TEMPLATES / FAMILIES[kind].template
    if not path.exists():
        raise FileNotFoundError(f"{path}: the real chat templates are unpacked by `make install` "
                                "(python -m scripts.chat_templates)")
    return path.read_text()


def thinking_tokenizer(kind: str):
    """The tiny BPE tokenizer with `kind`'s special tokens (special, as in the real ones), its
    added tags (Qwen's <think> and <tool_call>: text, as in Qwen's) and its template."""
    family = FAMILIES[kind]
    tokenizer = build_tokenizer(VOCAB - 32)
    tokenizer.add_special_tokens({"additional_special_tokens": family.special})
    tokenizer.add_tokens(family.added)
    tokenizer.chat_template = chat_template(kind)
    tokenizer.eos_token = family.eos[0]
    if family.bos is not None:
        tokenizer.bos_token = family.bos
    assert len(tokenizer) <= VOCAB
    return tokenizer


def write_thinking_model(kind: str, out_dir: Path) -> str:
    """A random model of `kind`'s architecture with its family's tokens and template, ending its
    answers as its family does (gpt-oss: <|return|>, or <|call|> after a call)."""
    family = FAMILIES[kind]
    tokenizer = thinking_tokenizer(kind)
    config = TINY_CONFIGS[family.architecture]()
    config.max_position_embeddings = 2048  # templates with tools write long system prompts
    if getattr(config, "sliding_window", None):
        config.sliding_window = 2048
    write_checkpoint(config, out_dir, seed=3, tokenizer=tokenizer)
    eos_ids = [tokenizer.convert_tokens_to_ids(token) for token in family.eos]
    GenerationConfig(eos_token_id=eos_ids, pad_token_id=0).save_pretrained(out_dir)
    config_path = out_dir / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json["eos_token_id"] = eos_ids
    config_path.write_text(json.dumps(config_json))
    return str(out_dir)


class ScriptedSampler:
    """Wraps an engine's sampler: a request whose prompt contains one of `scripts`' keys says
    that script's text, token by token, then ends with `end` (an EOS); other rows sample as
    usual. The tokens come from the tokenizer, so special tokens in the text are one token each.
    With `end` None the script is a beginning: the model goes on freely after it."""

    def __init__(self, sampler, tokenizer, scripts: dict[str, str | tuple[str, str | None]], end: str | None) -> None:
        self.sampler, self.tokenizer = sampler, tokenizer
        self.scripts = {}
        for key, script in scripts.items():
            text, script_end = script if isinstance(script, tuple) else (script, end)  # a script may end its own way
            end_ids = [tokenizer.convert_tokens_to_ids(script_end)] if script_end else []
            self.scripts[key] = tokenizer.encode(text, add_special_tokens=False) + end_ids
        self.by_prompt: dict[tuple[int, ...], list[int] | None] = {}

    def script_of(self, prompt_token_ids: list[int]) -> list[int] | None:
        key = tuple(prompt_token_ids)
        if key not in self.by_prompt:
            prompt = self.tokenizer.decode(prompt_token_ids)
            self.by_prompt[key] = next((ids for trigger, ids in self.scripts.items() if trigger in prompt), None)
        return self.by_prompt[key]

    def __call__(self, logits: torch.Tensor, rows):
        for index, row in enumerate(rows):
            script = self.script_of(row.prompt_token_ids)
            position = len(row.output_token_ids)
            if script is not None and position < len(script):
                logits[index] = float("-inf")
                logits[index, script[position]] = 0.0
        return self.sampler(logits, rows)

    def __getattr__(self, name):
        return getattr(self.sampler, name)
