"""Attention and hot-path kernels: Triton on the GPU, torch references everywhere."""
