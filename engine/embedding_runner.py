"""Runs an embedding model over a packed batch of whole inputs: one forward pass, then
pooling. Encoders (engine/models/bert.py) and decoders (the generative definitions
without their LM head) alike; no KV cache, no sampling."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import ForwardContext
from engine.config import EngineConfig
from engine.devices import host_default_device, repeat_interleave
from engine.loader import load_weights, model_weights
from engine.model_runner import resolve_device, resolve_dtype
from engine.models import MODEL_REGISTRY, get_model_class
from engine.models.bert import BertModel, XLMRobertaModel
from engine.models.layers import (
    bucket_rows,
    can_use_onednn_linear,
    use_low_precision_linears,
    use_onednn_linears,
    use_triton_layers,
)
from engine.packed_attention import PackedAttentionMetadata, select_packed_backend
from engine.pooling import pool

ENCODERS = {"BertModel": BertModel, "XLMRobertaModel": XLMRobertaModel}


def embedding_model_class(hf_config) -> tuple[type[nn.Module], bool]:
    """(model class, is it an encoder). A decoder checkpoint saved without its head
    (`Qwen3Model`) runs as its causal-LM definition (`Qwen3ForCausalLM`) without the head."""
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in ENCODERS:
            return ENCODERS[name], True
    causal = [name.removesuffix("Model") + "ForCausalLM" if name.endswith("Model") else name for name in names]
    hf_config.architectures = causal
    try:
        return get_model_class(hf_config), False
    except ValueError:
        raise ValueError(f"architectures {names or None} cannot run as an embedding model; supported: "
                         f"{sorted(ENCODERS)} and the decoders {sorted(MODEL_REGISTRY)}") from None
    finally:
        hf_config.architectures = names


class EmbeddingModelRunner:
    def __init__(self, config: EngineConfig, hf_config) -> None:
        if config.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size: embedding models run on one device (they are small); "
                             "start one worker per device instead")
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device, config.attention_backend)
        model_cls, self.is_encoder = embedding_model_class(hf_config)
        # Encoders in bf16/fp16: the matmuls and attention in it, LayerNorms and the residual
        # stream in fp32 (engine/models/layers.py: LowPrecisionLinear says why).
        self.is_mixed_precision = self.is_encoder and self.dtype != torch.float32
        self.weights_dtype = torch.float32 if self.is_mixed_precision else self.dtype
        self.is_causal = not self.is_encoder
        self.default_pooling = BertModel.default_pooling if self.is_encoder else "last"
        self.max_input_tokens = (model_cls.max_input_tokens(hf_config) if self.is_encoder
                                 else hf_config.max_position_embeddings)
        self.model = self._load_model(model_cls, hf_config)
        self.num_layers = hf_config.num_hidden_layers
        # Decoders with sliding windows: inputs are kept within the smallest, where it never binds.
        windows = [w for w in getattr(model_cls, "sliding_windows", lambda _: [])(hf_config) if w]
        self.smallest_window = min(windows) if windows else None
        self.backend = select_packed_backend(config.attention_backend, self.device)
        if self.backend.name == "triton":
            use_triton_layers(self.model)
        if self.is_mixed_precision:
            use_low_precision_linears(self.model, self.dtype)
            if self.backend.name == "cpu":  # the native library is built: LayerNorms write both dtypes
                self.model.use_native_layer_norms(self.dtype)
        elif config.onednn_linear and can_use_onednn_linear(self.device, self.dtype):
            use_onednn_linears(self.model, batch_size_hint=config.max_num_batched_tokens)
        # The native attention reads the inputs in place, so the batch can be padded once to the
        # row count the oneDNN matmuls run at (layers.py: bucket_rows) instead of copied into it
        # at each matmul. Pad rows belong to no input: they attend to nothing and are never pooled.
        self.pad_rows = self.backend.name == "cpu"

    def _load_model(self, model_cls: type[nn.Module], hf_config) -> nn.Module:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.weights_dtype)
        try:
            with torch.device(self.device):
                model = model_cls(hf_config, max_positions=hf_config.max_position_embeddings)
        finally:
            torch.set_default_dtype(previous)
        if not self.is_encoder:
            model.lm_head = None  # hidden states are the output; a checkpoint's head is skipped
        rename = getattr(model_cls, "checkpoint_name", None) or (
            lambda name: None if name.startswith("lm_head.") else name)
        weights = ((target, tensor) for name, tensor in model_weights(self.config.model, model, hf_config, self.weights_dtype)
                   if (target := rename(name)) is not None)
        counts = load_weights(model, weights)
        self.num_params = counts.total
        return model.eval()

    @torch.inference_mode()
    def embed(self, token_ids: list[list[int]], pooling_type: str) -> torch.Tensor:
        """Inputs' token ids -> pooled hidden states [num_inputs, hidden] fp32 (not normalized)."""
        with host_default_device():  # the inputs are built on the host (engine/devices.py)
            return self._embed(token_ids, pooling_type)

    def _embed(self, token_ids: list[list[int]], pooling_type: str) -> torch.Tensor:
        seq_lens = [len(ids) for ids in token_ids]
        num_tokens = sum(seq_lens)
        num_rows = bucket_rows(num_tokens) if self.pad_rows else num_tokens
        input_ids = torch.zeros(num_rows, dtype=torch.long)  # [R]: the tokens, then pad rows of id 0
        input_ids[:num_tokens] = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long)
        meta = PackedAttentionMetadata.build(seq_lens, self.is_causal, self.device, num_rows)
        lens = torch.tensor(seq_lens)
        positions = torch.zeros(num_rows, dtype=torch.long)  # [R]: 0.. within each input, 0 on pad rows
        positions[:num_tokens] = torch.arange(num_tokens) - repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        ctx = ForwardContext(meta, [(None, None)] * self.num_layers, self.backend)
        hidden = self.model(input_ids.to(self.device), positions.to(self.device), ctx)  # [R, hidden]
        return pool(hidden[:num_tokens], seq_lens, pooling_type)
