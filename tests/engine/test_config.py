from engine import LLM
from engine.config import EngineConfig, parse_memory


def test_parse_memory_units():
    assert parse_memory("2GiB") == 2 * 1024**3
    assert parse_memory("512MiB") == 512 * 1024**2
    assert parse_memory("1.5GB") == 1_500_000_000
    assert parse_memory(4096) == 4096
    assert EngineConfig(model="m", kv_cache_memory="1KiB").kv_cache_memory == 1024


def test_kv_cache_memory_sizes_the_pool(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_memory="1MiB")
    runner = llm.engine.model_runner
    # 2 layers x (K, V) x 16 slots x 2 KV heads x 16 dims x 4 bytes = 8 KiB per block
    assert runner.bytes_per_block == 8192
    assert llm.engine.num_total_blocks == 128
    assert tuple(runner.kv_cache_groups[0].shape) == (2, 2, 128, 16, 2, 16)


def test_cpu_default_pool_holds_max_num_seqs_full_sequences(tiny_llama):
    llm = LLM(tiny_llama, max_num_seqs=4, max_model_len=100)
    assert llm.engine.num_total_blocks == 4 * 7  # ceil(100 / 16) = 7 blocks each
