"""`LLM`: the offline facade, shaped like vLLM's."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.lora.request import LoRARequest
from engine.outputs import EmbeddingRequestOutput, RequestOutput
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams
from engine.tasks import create_engine

Prompt = str | list[int]


class LLM:
    """Load a Hugging Face checkpoint and generate completions with continuous batching.

    >>> llm = LLM(model="out/demo-model", num_kv_blocks=256)
    >>> llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8))[0].text

    Options are EngineConfig's fields (e.g. num_kv_blocks, dtype, skip_tokenizer_init). An
    embedding model (engine/tasks.py) embeds instead, as vLLM's LLM.embed:

    >>> LLM(model="demo-embedding").embed(["a fleet of workers"])[0].outputs[0].embedding
    """

    def __init__(self, model: str, **options) -> None:
        self.engine = create_engine(EngineConfig(model=model, **options))
        self._next_id = 0

    def shutdown(self) -> None:
        """Stop a tensor-parallel engine's other ranks (their processes also end with this one)."""
        self.engine.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without its own SamplingParams runs with: the model's
        generation_config.json defaults (--generation-config auto), as in vLLM."""
        return SamplingParams(**self.engine.default_sampling_params)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | SequenceOf[Prompt],
                 sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | SequenceOf[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Prompts are strings or token-id lists; one SamplingParams for all, or one each;
        one LoRARequest for all, or one (or None: the base model) each (enable_lora).
        Every request is validated before any runs; outputs come back in input order."""
        if self.engine.task != "generate":
            raise ValueError(f"generate: {self.engine.config.model} is an embedding model; use embed()")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"lora_request: {len(lora_request)} given for {len(prompts)} prompts")
        request_ids = []
        for index, (prompt, params, lora) in enumerate(zip(prompts, sampling_params, lora_request)):
            request_id = str(self._next_id)
            self._next_id += 1
            try:
                self.engine.add_request(request_id, prompt, params, lora_request=lora)
            except ValueError as error:
                for queued in request_ids:  # all or nothing: leave the engine as it was
                    self.engine.abort(queued)
                raise type(error)(f"prompts[{index}]: {error}") from None  # same class, with the index
            request_ids.append(request_id)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generate", disable=not use_tqdm) as progress:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    results[output.request_id] = output
                    progress.update(1)
        return [results[request_id] for request_id in request_ids]

    def embed(self, prompts: Prompt | SequenceOf[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One output per prompt (a string or token ids), in input order, its vector in
        `outputs[0].embedding`. Every prompt is validated before any runs."""
        if self.engine.task != "embed":
            raise ValueError(f"embed: {self.engine.config.model} generates text; start LLM with task='embed' to "
                             "run it as an embedding model")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        processed = []
        for index, prompt in enumerate(prompts):
            try:
                processed.append(self.engine.process_request(str(self._next_id + index), [prompt], pooling_params))
            except ValueError as error:
                raise type(error)(f"prompts[{index}]: {error}") from None  # same class, with the index
        self._next_id += len(prompts)
        for request in processed:
            self.engine.add_processed_request(request)
        results: dict[str, EmbeddingRequestOutput] = {}
        with tqdm(total=len(prompts), desc="embed", disable=not use_tqdm) as progress:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    results[output.request_id] = output
                    progress.update(1)
        return [results[request.request_id] for request in processed]
