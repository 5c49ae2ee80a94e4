"""Attention and hot-path kernels: Triton on the GPU, torch references everywhere."""


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division of positive integers (blocks needed for a token count, grid sizes)."""
    return -(-numerator // denominator)
