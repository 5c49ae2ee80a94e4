"""Embedding models against their references: the real all-MiniLM-L6-v2 against
sentence-transformers' encode (cosine >= 0.9999), tiny random encoders (BERT, XLM-R) and
decoder embedding models (Qwen3 with last-token pooling, a Llama run with --task embed)
against their transformers forward pass and the pooling rule; limits, truncation,
Matryoshka dimensions and bad input."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForCausalLM

from engine import (
    ContextLengthExceeded,
    EmbeddingEngine,
    EngineConfig,
    LLMEngine,
    PoolingParams,
    create_engine,
)
from engine.pooling import load_pooler_config
from tests.embedding_models import (
    MATRYOSHKA_DIMENSIONS,
    matryoshka_minilm,
    minilm_folder,
    texts,
    write_embedding_checkpoint,
)

COSINE = 0.9999  # against sentence-transformers (the bar)
TINY_COSINE = 0.99999  # against transformers on tiny models, fp32


def embed(engine: EmbeddingEngine, inputs, params: PoolingParams | None = None) -> torch.Tensor:
    engine.add_request("r", inputs, params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    (output,) = outputs
    return torch.tensor([o.embedding for o in output.outputs])


@pytest.fixture(scope="module")
def minilm() -> EmbeddingEngine:
    return create_engine(EngineConfig(model="demo-embedding", max_num_batched_tokens=2048))


@pytest.fixture(scope="module")
def sentence_transformer():
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415

    return SentenceTransformer(str(minilm_folder()), device="cpu")


def test_minilm_matches_sentence_transformers(minilm, sentence_transformer):
    """200 texts from 1 word to past max_seq_length (the long ones truncated, as
    sentence-transformers truncates them: first tokens, [SEP] kept)."""
    batch = texts(200)
    lengths = [len(minilm.tokenizer(t)["input_ids"]) for t in batch]
    assert min(lengths) <= 3 and max(lengths) > 256 and sum(n > 256 for n in lengths) >= 10
    expected = sentence_transformer.encode(batch, convert_to_tensor=True, batch_size=64)
    got = embed(minilm, batch, PoolingParams(truncate_prompt_tokens=-1))
    cosine = F.cosine_similarity(got, expected)
    assert cosine.min() >= COSINE, cosine.min()
    assert torch.allclose(got.norm(dim=1), torch.ones(200), atol=1e-5)  # the Normalize module


def test_minilm_pooler_config_from_sentence_transformers_files(minilm):
    pooler = minilm.pooler_config
    assert (pooler.pooling_type, pooler.normalize, pooler.max_seq_length) == ("mean", True, 256)
    assert minilm.max_model_len == 256 and not pooler.is_matryoshka


def test_matryoshka_dimensions_truncate_then_normalize(tmp_path, sentence_transformer):
    engine = create_engine(EngineConfig(model=str(matryoshka_minilm(tmp_path / "m"))))
    batch = texts(24, seed=3, longest_words=150)
    full = sentence_transformer.encode(batch, convert_to_tensor=True)
    for dimensions in MATRYOSHKA_DIMENSIONS[1:]:
        got = embed(engine, batch, PoolingParams(dimensions=dimensions))
        assert got.shape == (24, dimensions)
        expected = F.normalize(full[:, :dimensions], dim=1)
        assert F.cosine_similarity(got, expected).min() >= COSINE
        assert torch.allclose(got.norm(dim=1), torch.ones(24), atol=1e-5)
    with pytest.raises(ValueError, match=r"dimensions: 100 is not supported by this model; use one of \[384, 256"):
        engine.process_request("x", ["a"], PoolingParams(dimensions=100))


def test_limits_and_bad_input(minilm):
    long_text = "word " * 400
    with pytest.raises(ContextLengthExceeded, match=r"input\[1\]: 402 tokens exceed this model's limit of 256"):
        minilm.process_request("x", ["short", long_text])
    assert len(minilm.process_request("x", [long_text], PoolingParams(truncate_prompt_tokens=100))
               .prompt_token_ids[0]) == 100
    ids = minilm.process_request("x", [long_text], PoolingParams(truncate_prompt_tokens=-1)).prompt_token_ids[0]
    assert len(ids) == 256 and ids[0] == minilm.tokenizer.cls_token_id and ids[-1] == minilm.tokenizer.sep_token_id
    # Token ids are used as given: no special tokens added, truncation keeps the first.
    assert minilm.process_request("x", [[5, 6, 7]]).prompt_token_ids == [[5, 6, 7]]
    assert minilm.process_request("x", [list(range(300))], PoolingParams(truncate_prompt_tokens=-1)) \
        .prompt_token_ids == [list(range(256))]
    with pytest.raises(ValueError, match=r"input: token ids must be integers in \[0, 30522\)"):
        minilm.process_request("x", [[30522]])
    with pytest.raises(ValueError, match="truncate_prompt_tokens: 300 must be -1 or 1 to the model's limit of 256"):
        minilm.process_request("x", ["a"], PoolingParams(truncate_prompt_tokens=300))
    with pytest.raises(ValueError, match="dimensions: this model does not support Matryoshka"):
        minilm.process_request("x", ["a"], PoolingParams(dimensions=64))
    with pytest.raises(ValueError, match="input: must not be empty"):
        minilm.process_request("x", [[]])
    assert not minilm.has_unfinished()


def test_steps_pack_by_token_budget_shortest_first(minilm):
    """One step takes inputs up to max_num_batched_tokens (2048 here), shortest first; an
    aborted request's inputs never run."""
    lengths = [150, 10, 250, 40, 250] + [250] * 6
    inputs = [list(range(1000, 1000 + n)) for n in lengths]
    minilm.add_request("a", inputs[:5])
    minilm.add_request("b", inputs[5:])
    minilm.add_request("c", [[7] * 20])
    minilm.abort("c")
    chosen = minilm.schedule()
    assert [len(p.token_ids) for p in chosen] == [10, 40, 150] + [250] * 7  # 1,950 tokens; 8 x 250 would not fit
    assert [(p.request_id, p.index) for p in chosen[3:]] == [("a", 2), ("a", 4)] + [("b", i) for i in range(5)]
    (a,) = minilm.step()
    assert a.request_id == "a" and [len(ids) for ids in a.prompt_token_ids] == lengths[:5]
    (b,) = minilm.step()  # its last input
    assert b.request_id == "b" and len(b.outputs) == 6 and not minilm.has_unfinished()


def test_packed_batch_equals_one_at_a_time(minilm):
    """Packing is exact: the same inputs embedded together or alone agree to fp32 rounding."""
    batch = texts(12, seed=5, longest_words=120)
    together = embed(minilm, batch)
    alone = torch.cat([embed(minilm, [text]) for text in batch])
    assert torch.allclose(together, alone, atol=1e-6)


def hf_hidden(folder, input_ids: list[int], causal_lm: bool = False) -> torch.Tensor:
    """transformers' last hidden state of one unpadded input: [len, hidden]."""
    if causal_lm:
        model = AutoModelForCausalLM.from_pretrained(folder).model
    else:
        model = AutoModel.from_pretrained(folder)
    with torch.no_grad():
        return model(input_ids=torch.tensor([input_ids])).last_hidden_state[0].float()


def reference_embeddings(folder, inputs: list[list[int]], pooling: str, normalize: bool,
                         causal_lm: bool = False) -> torch.Tensor:
    rows = []
    for ids in inputs:
        hidden = hf_hidden(folder, ids, causal_lm)
        row = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[pooling]
        rows.append(F.normalize(row, dim=0) if normalize else row)
    return torch.stack(rows)


def token_inputs(count: int, vocab: int, longest: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("name, pooling", [("bert", "cls"), ("bert", "mean"), ("xlm_roberta", "mean")])
def test_tiny_encoders_match_transformers(tmp_path, tiny_tokenizer, name, pooling):
    folder = write_embedding_checkpoint(name, tmp_path / name, tiny_tokenizer)
    engine = create_engine(EngineConfig(model=str(folder), pooling=pooling, max_num_batched_tokens=256))
    assert isinstance(engine, EmbeddingEngine) and engine.pooler_config.pooling_type == pooling
    inputs = token_inputs(10, len(tiny_tokenizer), engine.max_model_len)
    got = embed(engine, inputs)
    expected = reference_embeddings(folder, inputs, pooling, normalize=False)
    assert F.cosine_similarity(got, expected).min() >= TINY_COSINE
    assert torch.allclose(got, expected, atol=1e-4)


def test_xlm_roberta_limit_is_positions_past_the_padding_offset(tmp_path, tiny_tokenizer):
    folder = write_embedding_checkpoint("xlm_roberta", tmp_path / "x", tiny_tokenizer)
    assert create_engine(EngineConfig(model=str(folder))).max_model_len == 130 - 1  # pad_token_id 0 -> offset 1


def test_qwen3_embedding_last_token_from_sentence_transformers_files(tmp_path, tiny_tokenizer):
    """A Qwen3Model folder with lasttoken pooling and Normalize is an embedding model (auto)."""
    folder = write_embedding_checkpoint("qwen3_embedding", tmp_path / "q", tiny_tokenizer,
                                        {"pooling": "lasttoken", "normalize": True, "max_seq_length": 64})
    engine = create_engine(EngineConfig(model=str(folder)))
    assert isinstance(engine, EmbeddingEngine) and engine.max_model_len == 64
    assert (engine.pooler_config.pooling_type, engine.pooler_config.normalize) == ("last", True)
    inputs = token_inputs(9, len(tiny_tokenizer), 64, seed=2)
    got = embed(engine, inputs)
    expected = reference_embeddings(folder, inputs, "last", normalize=True)
    assert F.cosine_similarity(got, expected).min() >= TINY_COSINE


def test_causal_lm_checkpoint_as_embedding_model(tiny_models):
    """--task embed on a LlamaForCausalLM checkpoint: the LM head is skipped, last-token pooling."""
    engine = create_engine(EngineConfig(model=tiny_models["llama"], task="embed", normalize=True))
    assert isinstance(engine, EmbeddingEngine) and engine.pooler_config.pooling_type == "last"
    inputs = token_inputs(6, 512, 40, seed=4)
    got = embed(engine, inputs)
    expected = reference_embeddings(tiny_models["llama"], inputs, "last", normalize=True, causal_lm=True)
    assert F.cosine_similarity(got, expected).min() >= TINY_COSINE
    assert isinstance(create_engine(EngineConfig(model=tiny_models["llama"], num_kv_blocks=16)), LLMEngine)


def test_sliding_window_caps_decoder_inputs(tiny_models):
    """Inputs stay within the smallest window (48 in the tiny Mistral), where it never binds."""
    engine = create_engine(EngineConfig(model=tiny_models["mistral"], task="embed"))
    assert engine.max_model_len == 48


def test_pooler_config_flags_and_refusals(tmp_path, tiny_tokenizer):
    folder = write_embedding_checkpoint("bert", tmp_path / "b", tiny_tokenizer,
                                        {"pooling": "cls_token", "normalize": False})
    config = load_pooler_config(folder, None, None, None, "cls")
    assert (config.pooling_type, config.normalize, config.source) == ("cls", False,
                                                                      "sentence-transformers (1_Pooling)")
    assert load_pooler_config(folder, None, "mean", True, "cls").pooling_type == "mean"  # flags win
    (folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    with pytest.raises(ValueError, match="asks for a pooling kvfleet does not run"):
        load_pooler_config(folder, None, None, None, "cls")
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps(modules + [
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match="has modules kvfleet does not run: Dense"):
        load_pooler_config(folder, None, None, None, "cls")
    with pytest.raises(ValueError, match="tensor_parallel_size: embedding models run on one device"):
        create_engine(EngineConfig(model="demo-embedding", tensor_parallel_size=2))


def test_llm_embed_is_vllm_s_offline_api(sentence_transformer):
    from engine import LLM  # noqa: PLC0415

    llm = LLM("demo-embedding")  # auto: bf16 matmuls on a CPU that has them, else fp32
    batch = texts(200)
    outputs = llm.embed(batch, PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    got = torch.tensor([o.outputs[0].embedding for o in outputs])
    expected = sentence_transformer.encode(batch, convert_to_tensor=True, batch_size=64)
    assert F.cosine_similarity(got, expected).min() >= COSINE  # bf16: with fp32 LayerNorms and residuals
    with pytest.raises(ValueError, match=r"prompts\[1\]: input: .* exceed this model's limit of 256"):
        llm.embed(["fine", "word " * 300])
    with pytest.raises(ValueError, match="is an embedding model; use embed"):
        llm.generate(["x"])


@pytest.mark.parametrize("pipeline", [None, {"pooling": "cls_token", "normalize": True, "max_seq_length": 32}],
                         ids=["bare-folder", "cls-normalize"])
def test_defaults_are_what_sentence_transformers_does_on_the_folder(tmp_path, tiny_tokenizer, pipeline):
    """A bare folder: mean pooling, no normalization; a pipeline's files: theirs (and its limit)."""
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415

    folder = write_embedding_checkpoint("bert", tmp_path / "b", tiny_tokenizer, pipeline)
    engine = create_engine(EngineConfig(model=str(folder)))
    batch = texts(12, seed=6, longest_words=60)
    got = embed(engine, batch, PoolingParams(truncate_prompt_tokens=-1))
    expected = SentenceTransformer(str(folder), device="cpu").encode(batch, convert_to_tensor=True)
    assert F.cosine_similarity(got, expected).min() >= TINY_COSINE
    assert torch.allclose(got, expected, atol=1e-4)
