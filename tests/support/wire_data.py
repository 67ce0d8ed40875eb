"""Inputs and a bitwise comparison shared by the block wires' multirank tests (the rings, the
direct shape, the lower wires)."""

from __future__ import annotations

import numpy as np
import torch


def scaled_input(rank: int, d: int, seed: int) -> torch.Tensor:
    """Rank ``rank``'s ``d`` Gaussian values, each scaled by a random power of two in 2^-6..2^5."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(d, generator=g) * torch.exp2(torch.randint(-6, 6, (d,), generator=g).float())


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equal as float32 (NaN equal to NaN), the same shape."""
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    return a.shape == b.shape and bool(((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))).all())
