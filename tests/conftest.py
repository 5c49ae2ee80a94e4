"""Fixtures shared by every test folder: tiny random-weight checkpoints of each
supported architecture, written once per session as Hugging Face safetensors."""

from __future__ import annotations

import os

import torch

# Triton kernels run on the CPU only in its interpreter, which is read when a kernel
# module is imported: set it before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from transformers import LlamaConfig, MistralConfig, OPTConfig, Qwen2Config  # noqa: E402

from engine.demo_model import build_tokenizer, write_checkpoint  # noqa: E402

torch.set_num_threads(2)

VOCAB = 512
TINY_CONFIGS = {
    # GQA (4 query heads over 2 KV heads) and Llama 3 RoPE scaling.
    "llama": lambda: LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        architectures=["LlamaForCausalLM"]),
    # MQA, and a sliding window shorter than the longest prompts.
    "mistral": lambda: MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=512, sliding_window=48, initializer_range=0.1,
        architectures=["MistralForCausalLM"]),
    # q/k/v biases, tied embeddings.
    "qwen2": lambda: Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.1,
        architectures=["Qwen2ForCausalLM"]),
    # facebook/opt-125m's shape, shrunk: pre-LayerNorm, ReLU, learned positions, tied head.
    "opt": lambda: OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, word_embed_proj_dim=64, do_layer_norm_before=True, init_std=0.1,
        architectures=["OPTForCausalLM"]),
}


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer(VOCAB)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tiny_tokenizer) -> dict[str, str]:
    """Architecture name -> checkpoint directory."""
    root = tmp_path_factory.mktemp("models")
    return {name: str(write_checkpoint(make(), root / name, seed=1, tokenizer=tiny_tokenizer))
            for name, make in TINY_CONFIGS.items()}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> str:
    return tiny_models["llama"]


# -- services ------------------------------------------------------------------
import uuid  # noqa: E402

import boto3  # noqa: E402
import redis  # noqa: E402

from tests.services import RedisServer, S3Server, s3_environment  # noqa: E402


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture
def r(redis_server) -> redis.Redis:
    """A client on an emptied database of the session's redis-server."""
    if redis_server.process.poll() is not None:  # a test killed it: bring it back
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    return client


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server().start()
    saved = {k: os.environ.get(k) for k in s3_environment(server.url)}
    os.environ.update(s3_environment(server.url))
    yield server
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def s3_bucket(s3_server) -> str:
    name = f"kvfleet-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server.url).create_bucket(Bucket=name)
    return name
