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

from engine.demo_model import build_tokenizer, demo_config, write_checkpoint  # noqa: E402
from tests.tiny_models import TINY_CONFIGS, VOCAB  # noqa: E402

# Under pytest-xdist two test processes share the two cores: one thread each, no oversubscription.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

# Tests that start fleets of worker, API or browser processes run in either xdist process, beside
# the other's tests, so they wait on progress, never on time. (pytest-xdist 3.8's xdist_group does
# nothing under pytest 9: it renames items through a field pytest 9 no longer reads.)


@pytest.fixture(scope="session", autouse=True)
def fp32_engines():
    """Engines built in this process resolve dtype auto to fp32, as on a CPU without native
    bf16: the suite's oracles are exact tokens (transformers fp32, the same requests run one
    at a time), which bf16 does not keep across batch shapes. bf16 tests name their dtype;
    tests/engine/test_dtype.py covers auto itself. Workers started as processes get --dtype."""
    with pytest.MonkeyPatch.context() as patch:  # session-wide: module-scoped engines too
        patch.setattr("engine.model_runner.cpu_has_native_bf16", lambda: False)
        yield


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


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> str:
    """The checkpoint `make demo` and `workers.serve` users start with (engine/demo_model.py)."""
    return str(write_checkpoint(demo_config(), tmp_path_factory.mktemp("demo-model")))


# -- services ------------------------------------------------------------------
# Imported inside the fixtures: the kernel and engine tests also run where only the
# engine's own dependencies are installed (scripts/gpu_check.py on a GPU machine).


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    from tests.services import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture
def r(redis_server):
    """A client on an emptied database of the session's redis-server."""
    import redis

    if redis_server.process.poll() is not None:  # a test killed it: bring it back
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    return client


@pytest.fixture(scope="session")
def s3_server():
    from tests.services import S3Server, s3_environment

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
    import uuid

    import boto3

    name = f"kvfleet-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server.url).create_bucket(Bucket=name)
    return name
