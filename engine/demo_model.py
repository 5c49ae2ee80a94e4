"""Write a small Llama in Hugging Face layout, with no download:
deterministic random weights, a byte-level BPE tokenizer trained on the text in
engine/data/corpus.txt, and a chat template.

    python -m engine.demo_model OUT_DIR [--force]

Tests build their tiny Llama/Mistral/Qwen2/OPT checkpoints through `write_checkpoint`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the shipped corpus; ids 0, 1, 2 are <pad>, <s>, </s>.
    Encoding prepends <s>, as Llama tokenizers do."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS.read_text().splitlines(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE)


def write_checkpoint(config, out_dir: str | Path, seed: int = 0, tokenizer=None,
                     dtype: torch.dtype = torch.float32) -> Path:
    """Random-weight model of `config` (a transformers config) saved as safetensors,
    with a tokenizer and generation config, loadable by transformers and kvfleet."""
    out_dir = Path(out_dir)
    tokenizer = tokenizer or build_tokenizer(config.vocab_size)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 0
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def demo_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                       architectures=["LlamaForCausalLM"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.demo_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--force", action="store_true", help="rewrite even if OUT_DIR holds a model")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    out = Path(args.out_dir)
    if (out / "model.safetensors").exists() and not args.force:
        print(f"demo model already at {out}")
        return
    write_checkpoint(demo_config(), out)
    print(f"demo model written to {out}")


if __name__ == "__main__":
    main()
