"""The only engine class that touches tensors: loads the model, owns the paged KV
cache, turns a ScheduledBatch into input tensors (engine/model_inputs.py), runs the model,
samples.

With tensor_parallel_size N, rank 0's runner spawns ranks 1..N-1 (engine/shard.py),
broadcasts each step's inputs to them, and samples from the gathered logits; every
rank runs `run` on the same inputs with its own shard and KV pool."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random

import torch

from engine import parallel
from engine.attention import ForwardContext, resolve_backend_name, select_backend
from engine.checkpoint import load_hf_config
from engine.config import EngineConfig
from engine.cpu_runtime import pin_threads
from engine.cuda_graphs import DecodeGraphs, ineligible_reason
from engine.devices import host_default_device
from engine.kv_cache import KVGroup, kv_groups, pool_sizes
from engine.kv_quant import kv_cache_torch_dtype, layer_kv_scales
from engine.loader import load_weights, model_weights
from engine.lora.manager import LoRAModelManager, SlotTable
from engine.lora.request import LoRARequest
from engine.model_inputs import ModelInputBuilder, step_inputs
from engine.models import get_model_class
from engine.models.layers import (
    can_use_onednn_linear,
    cpu_has_native_bf16,
    use_cpu_layers,
    use_onednn_linears,
    use_triton_layers,
)
from engine.models.moe import active_parameter_fraction
from engine.quantized_linear import add_quantized_counts, finish_quantized_load, quantized_bytes
from engine.sampler import Sampler, SamplerOutput, SamplerRow, first_argmax, token_seed
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.shard import StepInputs, free_init_method, send_exit, start_shards
from kvfleet_kernels import cdiv
from kvfleet_kernels.cpu_layers import argmax_rows
from kvfleet_kernels.reference import is_fp8

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_BYTES = 2 * 1024**3
CUDA_MEMORY_FRACTION = 0.9
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return device


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of a group on CUDA uses the r-th device from the configured one."""
    if device.type != "cuda" or rank == 0:
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def resolve_dtype(name: str, hf_config, device: torch.device, attention_backend: str = "auto") -> torch.dtype:
    """The dtype a model runs in. `auto`: on CUDA the checkpoint's own; on the CPU bf16 where
    the CPU multiplies bf16 natively (avx512_bf16 or AMX: vLLM-cpu's rule), else fp32, and
    fp32 under the Triton interpreter (it computes in fp32). Logged, since it decides speed
    (bf16 matmuls run ~6x the fp32 rate on AMX) and which outputs are bit-exact (fp32)."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
        return getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if attention_backend == "triton":
        logger.info("dtype auto: float32 (the Triton interpreter computes in fp32)")
        return torch.float32
    if cpu_has_native_bf16():
        logger.info("dtype auto: bfloat16 (this CPU has avx512_bf16 or AMX; --dtype float32 for fp32)")
        return torch.bfloat16
    logger.info("dtype auto: float32 (this CPU has neither avx512_bf16 nor AMX)")
    return torch.float32


@contextlib.contextmanager
def skip_random_init():
    """Parameters left as allocated while a model is built: every one is then filled from the
    checkpoint (engine/loader.py refuses a model with one missing), so drawing random values first
    only touched every page of the weights: a GGUF kept quantized peaked at its bf16 size plus its
    own while the dense parameters it replaces were being drawn."""
    names = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
             "xavier_normal_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, eos_token_ids: set[int], rank: int = 0,
                 init_method: str | None = None) -> None:
        self.config = config
        self.block_size = config.block_size
        self.eos_token_ids = eos_token_ids
        self.rank, self.world_size = rank, config.tensor_parallel_size
        self.device = rank_device(resolve_device(config.device), rank)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device, config.attention_backend)
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        self.vocab_size = hf_config.vocab_size
        max_positions = hf_config.max_position_embeddings
        self.max_model_len = config.max_model_len or max_positions
        if self.max_model_len > max_positions:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {max_positions}")
        torch.manual_seed(config.seed)
        self._seed_source = random.Random(config.seed)
        self.shards = []
        if self.world_size > 1:
            parallel.check_tensor_parallel(hf_config, self.world_size, self.device)
            if rank == 0:
                init_method = free_init_method()
                # Every rank runs the dtype rank 0 resolved: `auto` is not decided again elsewhere.
                resolved = dataclasses.replace(config, dtype=str(self.dtype).removeprefix("torch."))
                self.shards = start_shards(resolved, init_method, run_shard)
            try:
                parallel.init_group(rank, self.world_size, init_method, self.device)
            except Exception as error:
                self._stop_shards()
                raise parallel.ParallelGroupError(f"the tensor-parallel group did not form: {error}") from error
        self.model = self._load_model(hf_config)
        self.lora, self.lora_slots = self._enable_lora() if config.enable_lora else (None, None)
        self.backend = select_backend(config.attention_backend, self.device)
        if self.backend.name == "triton":
            use_triton_layers(self.model)
        elif self.backend.name == "cpu" and (self.dtype != torch.float32 or self.quantized_weight_bytes):
            # The native library is built. A dense fp32 model keeps torch's layers, whose summation
            # order its exact-token tests pin; one with quantized weights matches no fp32 product
            # bit for bit anyway, and a decode step spent ~40% outside its linears in those ops.
            use_cpu_layers(self.model)
        if self.lora is not None and self.backend.name == "cpu":
            self.lora.use_cpu_kernel()
        if config.onednn_linear and can_use_onednn_linear(self.device, self.dtype):
            use_onednn_linears(self.model, batch_size_hint=config.max_num_seqs)
        # longrope: tokens past this use the long factors (engine/models/layers.py); else None
        self.long_rope_after = next((m.long_rope_after for m in self.model.modules()
                                     if getattr(m, "long_rope_after", None) is not None), None)
        attention_layers = [m for m in self.model.modules() if hasattr(m, "num_kv_heads")]
        self.num_layers = len(attention_layers)
        self.num_kv_heads, self.head_dim = attention_layers[0].num_kv_heads, attention_layers[0].head_dim
        if is_fp8(self.kv_cache_dtype):  # engine/kv_quant.py: each layer's scales
            layer_kv_scales(attention_layers, getattr(self.model, "checkpoint_kv_scales", {}),
                            config.calculate_kv_scales)
        self._allocate_kv_cache(kv_groups(attention_layers))
        self.model_inputs = ModelInputBuilder(self.device, self.block_size, len(self.kv_groups),
                                              self.backend.reads_prefill_spans, self.long_rope_after)
        # Scales still to be computed would be frozen into the graphs at capture.
        self.decode_graphs = None if config.enforce_eager or config.calculate_kv_scales else self._try_decode_graphs()
        self.sampler = Sampler(argmax_rows if self.backend.name == "cpu" else first_argmax)
        self.structured = None  # engine.structured_outputs.StructuredOutputs, set with the first constraint

    def _try_decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs of decode steps where this runner allows them; None, with the reason
        logged, elsewhere or when the capture fails (the engine then serves eagerly)."""
        reason = ineligible_reason(self.model, self.device, self.backend.name, self.world_size, self.lora is not None)
        if reason is not None:
            logger.info("decode steps run eagerly: %s", reason)
            return None
        try:
            return self.capture_decode_graphs()
        except RuntimeError as error:  # a capture the driver refuses
            logger.warning("decode steps run eagerly: capturing CUDA graphs failed: %s", error)
            return None

    def capture_decode_graphs(self, graph_factory=None) -> DecodeGraphs:
        """One graph per padded decode batch size over this runner's model and KV cache;
        `graph_factory`: torch.cuda's graphs unless given (the tests' stand-in on the CPU)."""
        graphs = DecodeGraphs(self.model, self.backend, self.kv_caches, self.layer_groups, len(self.kv_groups),
                              self.block_size, self.max_model_len, self.config.max_num_seqs,
                              self.long_rope_after is not None, self.device, graph_factory)
        graphs.capture()
        return graphs

    def _load_model(self, hf_config) -> torch.nn.Module:
        model_cls = get_model_class(hf_config)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), skip_random_init():
                model = model_cls(hf_config, max_positions=self.max_model_len)
        finally:
            torch.set_default_dtype(previous)
        counts = load_weights(model, model_weights(self.config.model, model, hf_config, self.dtype,
                                                   keep_quantized=self._keeps_quantized()))
        finish_quantized_load(model, self.device)
        add_quantized_counts(counts, model)  # weights kept quantized bypass load_weights
        self.quantized_weight_bytes = quantized_bytes(model)
        # What one token reads: all but the experts, and top_k / num_experts of those.
        self.num_params = counts.total
        self.num_active_params = counts.total - counts.experts
        if counts.experts:
            self.num_active_params += round(counts.experts * active_parameter_fraction(hf_config))
        return model.eval()

    def _keeps_quantized(self) -> str | None:
        """Whose matmuls compute on quantized weights kept as they are: Triton's where attention runs
        on Triton (CUDA, or the interpreter) and quantized_kernels is True, else the native CPU
        library's where it builds (quantized_kernels True or None); None on several ranks (each
        rank's shard is cut from the dense weight)."""
        wanted = self.config.quantized_kernels
        if wanted is False or self.world_size > 1:
            return None
        if resolve_backend_name(self.config.attention_backend, self.device) == "triton":
            return "triton" if wanted else None  # auto: not before the kernels have run on a GPU
        from kvfleet_kernels.cpu_quantized_linear import available  # noqa: PLC0415 (builds the library)

        return "cpu" if self.device.type == "cpu" and available() else None

    def _enable_lora(self) -> tuple[LoRAModelManager, SlotTable | None]:
        """LoRA-aware linears in place of the loaded ones (before any kernel swap); rank 0
        also keeps the slot table."""
        config = self.config
        manager = LoRAModelManager(self.model, config.max_loras, config.max_lora_rank,
                                   config.max_cpu_loras or config.max_loras, self.device, self.dtype)
        return manager, SlotTable(config.max_loras) if self.rank == 0 else None

    @property
    def bytes_per_layer_block(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.kv_cache_dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        """A block of every layer: what one token slot of the full-attention pool costs
        when every layer reads that pool."""
        return self.num_layers * self.bytes_per_layer_block

    def _kv_cache_memory(self) -> int | None:
        """Bytes for the KV cache, or None when num_kv_blocks sizes it exactly."""
        if self.config.num_kv_blocks is not None:
            return None
        memory = self.config.kv_cache_memory
        if memory is None and self.device.type == "cuda":
            # After the weights (an MoE's experts are most of them): what loading left cached goes back first.
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(self.device)
            memory = int(free * CUDA_MEMORY_FRACTION)
        elif memory is None:
            # Enough for max_num_seqs full-length sequences, never more than 2 GiB.
            blocks_for_all = self.config.max_num_seqs * cdiv(self.max_model_len, self.block_size)
            memory = min(CPU_DEFAULT_KV_CACHE_BYTES, blocks_for_all * self.bytes_per_block)
        return memory

    def _allocate_kv_cache(self, groups: list[KVGroup]) -> None:
        """One tensor per pool, [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim],
        zeroed so that padded reads of never-written slots are finite (masked, but
        NaN * 0 is NaN); `kv_caches[layer]` is that layer's (K, V), as the attention backend reads
        them (its cache_views)."""
        memory = self._kv_cache_memory()
        sizes = [parallel.group_min(n, self.device) for n in  # every rank: the same pools
                 pool_sizes(groups, self.config, self.bytes_per_layer_block, memory)]
        if min(sizes) < 1:
            raise ValueError(f"kv_cache_memory {memory} bytes holds no block of {self.bytes_per_block} bytes")
        self.kv_groups = groups
        self.kv_pools = [(size, group.sliding_window) for size, group in zip(sizes, groups)]
        self.num_kv_blocks = sizes[0]
        self.kv_cache_groups = [torch.zeros(len(group.layers), 2, size, self.block_size, self.num_kv_heads,
                                            self.head_dim, dtype=self.kv_cache_dtype, device=self.device)
                                for size, group in zip(sizes, groups)]
        self.kv_caches = [None] * self.num_layers
        self.layer_groups = [0] * self.num_layers  # the pool each layer reads
        for index, (group, cache) in enumerate(zip(groups, self.kv_cache_groups)):
            for position, layer in enumerate(group.layers):
                self.kv_caches[layer] = self.backend.cache_views(cache[position][0], cache[position][1])
                self.layer_groups[layer] = index

    # -- one step -------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SamplerOutput]:
        """Run the batch; return the sequences that produced a token, and their tokens."""
        with host_default_device():  # the step's host tensors stay on the host (engine/devices.py)
            return self._execute(batch)

    def _execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SamplerOutput]:
        # Prefills (more than one new token) first, then single-token decodes.
        order = sorted(range(len(batch)), key=lambda i: batch.num_new_tokens[i] == 1)
        seqs = [batch.seqs[i] for i in order]
        num_new = [batch.num_new_tokens[i] for i in order]
        # Rows whose sequence reaches its end this step sample a token; forked samples (n > 1)
        # draw from their parent's row.
        rows, sampled_seqs, row = [], [], 0
        for seq, n in zip(seqs, num_new):
            row += n
            if seq.num_computed_tokens + n == seq.num_tokens:
                for sampled in (seq, *batch.forks.get(seq.seq_id, ())):
                    rows.append(row - 1)
                    sampled_seqs.append(sampled)
        inputs = step_inputs(seqs, num_new, batch.block_copies, rows, len(self.kv_groups) == 2, self.lora_slots,
                             batch.running_adapters)
        logits = self.run(inputs) if self.world_size == 1 else self._run_group(inputs)
        if not rows:
            return [], SamplerOutput([], [])
        if self.structured is not None:
            self.structured.apply_masks(logits, [seq.grammar for seq in sampled_seqs])
        return sampled_seqs, self.sampler(logits, [self._sampler_row(s) for s in sampled_seqs])

    def _run_group(self, inputs: StepInputs) -> torch.Tensor | None:
        """Rank 0 of a group: send the inputs, run its own shard. A rank that died, or a
        collective that failed or timed out, is a ParallelGroupError: never a hang."""
        self._check_shards()
        try:
            inputs.broadcast(self.device)
            return self.run(inputs)
        except RuntimeError as error:
            self._check_shards()
            raise parallel.ParallelGroupError(f"tensor-parallel step failed: {error}") from error

    def _check_shards(self) -> None:
        for rank, shard in enumerate(self.shards, start=1):
            if not shard.is_alive():
                raise parallel.ParallelGroupError(f"tensor-parallel rank {rank} exited (exit code {shard.exitcode})")

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """Every rank: one forward pass on the step's inputs; the sampled rows' logits
        [R, vocab] on rank 0 (None elsewhere, or when nothing samples)."""
        for group, source, destination in inputs.copies.tolist():
            cache = self.kv_cache_groups[group]
            cache[:, :, destination].copy_(cache[:, :, source])
        if self.lora is not None:
            for slot, name, path in inputs.adapters_to_load():
                self.lora.activate(slot, LoRARequest(name, 0, path))
            self.lora.set_mapping(inputs.lora_slots, inputs.lens)
        input_ids, positions, metas = self.model_inputs.build(inputs)
        size = self.decode_graphs.padded_size(metas, len(input_ids)) if self.decode_graphs else None
        if size is not None:  # a decode-only step a captured graph covers
            hidden = self.decode_graphs.run(size, input_ids, positions, metas)  # [num_tokens, hidden]
        else:
            ctx = ForwardContext(metas[0], self.kv_caches, self.backend, metas, self.layer_groups)
            hidden = self.model(input_ids, positions, ctx)  # [num_tokens, hidden]
        if not len(inputs.rows):
            return None
        return self.model.compute_logits(hidden[self.model_inputs.to_device(inputs.rows)])  # [num_sampled, vocab]

    def shutdown(self) -> None:
        """Rank 0: stop ranks 1..N-1 and leave the group."""
        if self.world_size == 1 or self.rank != 0:
            return
        try:
            if all(shard.is_alive() for shard in self.shards):
                send_exit(self.device)
        except RuntimeError:
            pass
        self._stop_shards()
        parallel.destroy_group()

    def _stop_shards(self) -> None:
        for shard in self.shards:
            shard.join(timeout=10)
            if shard.is_alive():
                shard.kill()
                shard.join(timeout=10)
        self.shards = []

    def _sampler_row(self, seq: Sequence) -> SamplerRow:
        params = seq.params
        suppressed: list[int] = []
        if seq.num_output_tokens < params.min_tokens:
            suppressed = list(params.stop_token_ids) + ([] if params.ignore_eos else sorted(self.eos_token_ids))
        generator = None
        if not params.is_greedy:
            if seq.sampling_seed is None:  # unseeded: drawn once, then kept with the sequence
                seq.sampling_seed = self._seed_source.getrandbits(63)
            seed = token_seed(seq.sampling_seed, seq.sample_index, seq.num_output_tokens)
            generator = torch.Generator(device=self.device).manual_seed(seed)
        return SamplerRow(seq, generator, suppressed)


def run_shard(config_json: str, rank: int, init_method: str) -> None:
    """The main of ranks 1..N-1: load the shard, then run steps until rank 0 says exit.
    Any failure ends the process with an error, which fails rank 0's next collective."""
    config = EngineConfig(**json.loads(config_json))
    if not torch.cuda.is_available():  # the ranks share the host's cores: each pins its own share
        pin_threads("cpu", config.tensor_parallel_size, rank)
    runner = ModelRunner(config, load_hf_config(config.model), set(), rank=rank,
                         init_method=init_method)
    with torch.inference_mode():
        while (inputs := StepInputs.receive(runner.device)) is not None:
            runner.run(inputs)
    parallel.destroy_group()
