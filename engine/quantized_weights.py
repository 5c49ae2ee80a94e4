"""GGUF's quantized tensors in the one form kvfleet's quantized linears compute on
(kvfleet_kernels/cpu_quantized_linear.py): per output row and group of G input features,
w = a * code - b with unsigned codes of 4, 6 or 8 bits and a, b in fp16 (6 bits: codes below
64, packed as a 4-bit plane and a 2-bit one).

Each block type is read as ggml defines it (ggml-common.h; gguf-py's dequantizers follow the same
layouts, and the tests check every type against them):

    type   block  codes                         a          b           bits  G
    Q4_0   32     4-bit nibbles                 d          8 d         4     32
    Q4_1   32     4-bit nibbles                 d          -m          4     32
    Q5_0   32     nibble | high bit << 4        d          16 d        6     32
    Q5_1   32     nibble | high bit << 4        d          -m          6     32
    Q8_0   32     int8 + 128                    d          128 d       8     32
    Q4_K   256    4-bit, 8 sub-blocks of 32     d sc_j     dmin m_j    4     32
    Q5_K   256    5-bit, 8 sub-blocks of 32     d sc_j     dmin m_j    6     32
    Q6_K   256    6-bit, 16 sub-blocks of 16    d sc_j     32 a        6     16

a and b are exact in fp16 for the legacy types; a K-quant's d * sc_j (an fp16 times a 6- or 8-bit
integer) is rounded once to fp16, a relative 2^-11 beside the format's own 4-6 bits. Q2_K and Q3_K
are not kept quantized: engine/gguf_loader.py dequantizes them at load, as every type before.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

from kvfleet_kernels.cpu_quantized_linear import QuantizedWeight

Q = GGMLQuantizationType


def _halves(blocks: np.ndarray, offset: int, count: int = 1) -> np.ndarray:
    """`count` fp16 values at byte `offset` of each block, as fp32 [n_blocks, count]."""
    return blocks[:, offset:offset + 2 * count].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """[n, bytes] -> [n, 2 * bytes]: each run of `run` bytes gives its low nibbles, then its high."""
    n = qs.shape[0]
    both = qs.reshape(n, -1, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (both & 0x0F).reshape(n, -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Q5_0/Q5_1's 32-bit qh -> bit i of element i, [n, count]."""
    bits = qh.copy().view(np.uint32).reshape(-1, 1) >> np.arange(count, dtype=np.uint32).reshape(1, -1)
    return (bits & 1).astype(np.uint8)


def q4_0(blocks):
    d = _halves(blocks, 0)
    return _nibbles(blocks[:, 2:], 16), d, 8 * d, 4


def q4_1(blocks):
    d, m = _halves(blocks, 0), _halves(blocks, 2)
    return _nibbles(blocks[:, 4:], 16), d, -m, 4


def q5_0(blocks):
    d = _halves(blocks, 0)
    codes = _nibbles(blocks[:, 6:], 16) | (_high_bits(blocks[:, 2:6], 32) << 4)
    return codes, d, 16 * d, 6


def q5_1(blocks):
    d, m = _halves(blocks, 0), _halves(blocks, 2)
    codes = _nibbles(blocks[:, 8:], 16) | (_high_bits(blocks[:, 4:8], 32) << 4)
    return codes, d, -m, 6


def q8_0(blocks):
    d = _halves(blocks, 0)
    codes = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, 128 * d, 8


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's per-sub-block (a, b), [n, 8] each: d * sc and dmin * m, sc and m the
    6-bit pairs gguf's own Q4_K.get_scale_min unpacks."""
    d, dmin = _halves(blocks, 0), _halves(blocks, 2)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    return d * sc.astype(np.float32), dmin * m.astype(np.float32)


def q4_k(blocks):
    a, b = _k_scales(blocks)
    return _nibbles(blocks[:, 16:], 32), a, b, 4


def q5_k(blocks):
    a, b = _k_scales(blocks)
    n = blocks.shape[0]
    qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # bit j: sub-block j
    codes = _nibbles(blocks[:, 48:], 32) | ((qh & 1).reshape(n, -1) << 4)
    return codes, a, b, 6


def q6_k(blocks):
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    low = _nibbles(ql, 64)  # per half of 128: ql[0:64] low nibbles, then high
    high = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    codes = low | (high.reshape(n, -1) << 4)
    a = _halves(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
    a = a.astype(np.float16).astype(np.float32)  # b = 32 a exactly, as ggml's (q - 32) * d * sc
    return codes, a, 32 * a, 6


KERNEL_TYPES = {Q.Q4_0: q4_0, Q.Q4_1: q4_1, Q.Q5_0: q5_0, Q.Q5_1: q5_1, Q.Q8_0: q8_0,
                Q.Q4_K: q4_k, Q.Q5_K: q5_k, Q.Q6_K: q6_k}


def gguf_quantized_weight(data: np.ndarray, tensor_type: GGMLQuantizationType, num_features: int) -> QuantizedWeight:
    """A reader tensor's raw blocks (uint8 [rows, bytes per row]) as a QuantizedWeight [rows,
    num_features] (PyTorch's layout: GGUF's ne0 is the input features)."""
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    blocks = np.ascontiguousarray(data).reshape(-1, type_size)
    codes, a, b, bits = KERNEL_TYPES[tensor_type](blocks)
    rows = blocks.shape[0] * block_size // num_features
    as_half = lambda values: torch.from_numpy(np.ascontiguousarray(values.astype(np.float16)).reshape(rows, -1))  # noqa: E731
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, num_features)),
                           as_half(a), as_half(b), bits)
