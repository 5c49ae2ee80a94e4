"""How an embedding model turns hidden states into one vector per input: the pooler
configuration, read as sentence-transformers reads a model folder, and the pooling itself.

    modules.json                  the pipeline: Transformer -> Pooling -> [Normalize]
    1_Pooling/config.json         pooling_mode_mean_tokens / _cls_token / _lasttoken
    sentence_bert_config.json     max_seq_length: the input limit (256 for all-MiniLM-L6-v2)
    config.json                   is_matryoshka / matryoshka_dimensions (as vLLM reads them)

Without those files the pooling comes from the flags (`--pooling mean|cls|last`,
`--normalize`), defaulting to what sentence-transformers does with a bare folder: mean
pooling, no normalization.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.devices import repeat_interleave

logger = logging.getLogger(__name__)

POOLING_TYPES = ("mean", "cls", "last")
# The sentence-transformers modules kvfleet runs: the model itself, its pooling, the L2 norm.
SENTENCE_TRANSFORMERS_MODULES = ("Transformer", "Pooling", "Normalize")
# 1_Pooling/config.json's flags -> kvfleet's pooling type (max and mean-sqrt-len are refused).
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                                "pooling_mode_lasttoken": "last"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # mean, cls or last
    normalize: bool  # L2-normalize each embedding (after any Matryoshka truncation)
    max_seq_length: int | None = None  # sentence-transformers' input limit, when the folder sets one
    matryoshka_dimensions: tuple[int, ...] | None = None  # the sizes it was trained for; () = any size
    source: str = "flags"  # where the pooling came from, for the start-up log

    @property
    def is_matryoshka(self) -> bool:
        return self.matryoshka_dimensions is not None


def _read_json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise ValueError(f"model: cannot read {path}: {error}") from None


def sentence_transformers_pooling(folder: Path) -> tuple[str | None, bool | None, str | None]:
    """(pooling type, normalize, the Pooling module's folder) from modules.json, or Nones."""
    modules = _read_json(folder / "modules.json")
    if not isinstance(modules, list):
        return None, None, None
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    unknown = sorted(set(types) - set(SENTENCE_TRANSFORMERS_MODULES))
    if unknown:  # a Dense projection, say: ignoring it would return other vectors than the model's
        raise ValueError(f"model: {folder / 'modules.json'} has modules kvfleet does not run: {', '.join(unknown)}; "
                         f"supported: {', '.join(SENTENCE_TRANSFORMERS_MODULES)}")
    normalize = "Normalize" in types
    if "Pooling" not in types:
        return None, normalize, None
    path = folder / str(types["Pooling"].get("path", ""))
    settings = _read_json(path / "config.json") or {}
    chosen = [mode for flag, mode in _SENTENCE_TRANSFORMERS_MODES.items() if settings.get(flag)]
    if any(settings.get(flag) for flag in _UNSUPPORTED_MODES) or len(chosen) > 1:
        raise ValueError(f"model: {path / 'config.json'} asks for a pooling kvfleet does not run; "
                         f"supported: one of {', '.join(POOLING_TYPES)}")
    return (chosen[0] if chosen else None), normalize, str(path.relative_to(folder))


def matryoshka_dimensions(hf_config) -> tuple[int, ...] | None:
    """vLLM's rule: `matryoshka_dimensions` lists the sizes; `is_matryoshka` allows any size."""
    dimensions = getattr(hf_config, "matryoshka_dimensions", None)
    if dimensions:
        return tuple(int(d) for d in dimensions)
    return () if getattr(hf_config, "is_matryoshka", False) else None


def load_pooler_config(folder: Path | None, hf_config, pooling: str | None, normalize: bool | None,
                       default_pooling: str) -> PoolerConfig:
    """The folder's sentence-transformers files first; flags override them; else
    `default_pooling` (mean for encoders, last for decoders) without normalization."""
    folder_pooling, folder_normalize, source = (sentence_transformers_pooling(folder) if folder is not None
                                                else (None, None, None))
    if pooling is not None and pooling not in POOLING_TYPES:
        raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {pooling!r}")
    bert_config = _read_json(folder / "sentence_bert_config.json") if folder is not None else None
    max_seq_length = (bert_config or {}).get("max_seq_length") if isinstance(bert_config, dict) else None
    config = PoolerConfig(
        pooling_type=pooling or folder_pooling or default_pooling,
        normalize=normalize if normalize is not None else bool(folder_normalize),
        max_seq_length=int(max_seq_length) if max_seq_length else None,
        matryoshka_dimensions=matryoshka_dimensions(hf_config),
        source=f"sentence-transformers ({source})" if source and pooling is None else "flags")
    return config


def pool(hidden: torch.Tensor, seq_lens: list[int], pooling_type: str) -> torch.Tensor:
    """hidden [num_tokens, H], sequences back to back -> [num_seqs, H] in fp32.
    mean: the average of every token (special tokens included, as sentence-transformers
    averages all unmasked tokens); cls: the first token; last: the last token."""
    lens = torch.tensor(seq_lens, device=hidden.device)
    ends = torch.cumsum(lens, 0)
    if pooling_type == "cls":
        return hidden[ends - lens].float()
    if pooling_type == "last":
        return hidden[ends - 1].float()
    sequence_of = repeat_interleave(range(len(seq_lens)), seq_lens).to(hidden.device)  # [T]
    sums = torch.zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, sequence_of, hidden.float())
    return sums / lens[:, None].to(torch.float32)


def finish_embedding(pooled: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """pooled [H] -> [dimensions or H]: Matryoshka truncation first, then the L2 norm."""
    embedding = pooled[:dimensions] if dimensions else pooled
    return F.normalize(embedding, p=2, dim=-1) if normalize else embedding


@dataclass(frozen=True)
class PoolingParams:
    """Per-request options of an embedding request (vLLM's names)."""

    dimensions: int | None = None  # Matryoshka: keep the first this many, then normalize
    truncate_prompt_tokens: int | None = None  # keep this many first tokens of a longer input; -1: the limit
