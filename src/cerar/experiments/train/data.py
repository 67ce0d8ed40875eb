"""The byte-level Shakespeare corpus: a fixed split and deterministic batches.

The corpus ships with the package (``cerar/data/shakespeare.txt.gz``, provenance in
``cerar/data/README.md``). Tokens are bytes (vocabulary 256), so nothing is downloaded.

* Split: the first 90% of the bytes train, the last 10% validate (as nanoGPT's Shakespeare;
  the works are in alphabetical order, so validation is the last works of the list, never seen
  in training).
* Training batches depend only on ``(seed, step)``: step ``t`` draws ``N x batch_size`` window
  offsets from a generator seeded with ``(seed, t)`` and rank ``r`` takes the ``r``-th slice.
  Every method therefore sees the same data in the same order, whatever it does to the
  gradients, and a run can restart at any step.
* Validation: ``n`` windows at evenly spaced offsets, the same for every seed and method.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import torch

from cerar._checks import check_float, check_int

__all__ = ["Split", "load_corpus", "load_split", "train_batch", "validation_batch"]

VAL_FRACTION = 0.1


@lru_cache(maxsize=1)
def load_corpus() -> bytes:
    """The corpus's 5,058,224 bytes (read once per process)."""
    path = resources.files("cerar") / "data" / "shakespeare.txt.gz"
    return gzip.decompress(path.read_bytes())


@dataclass(frozen=True)
class Split:
    """Training and validation tokens (``uint8`` tensors)."""

    train: torch.Tensor
    val: torch.Tensor


def load_split(val_fraction: float = VAL_FRACTION) -> Split:
    """The fixed split: the first ``1 - val_fraction`` of the bytes train, the rest validates."""
    val_fraction = check_float("val_fraction", val_fraction, positive=True, maximum=0.5)
    tokens = torch.frombuffer(bytearray(load_corpus()), dtype=torch.uint8)
    cut = int(len(tokens) * (1 - val_fraction))
    return Split(train=tokens[:cut], val=tokens[cut:])


def train_batch(
    split: Split, step: int, rank: int, world_size: int, batch_size: int, seq_len: int, seed: int
) -> torch.Tensor:
    """Rank ``rank``'s ``(batch_size, seq_len)`` int64 token batch of step ``step``."""
    step = check_int("step", step, minimum=0)
    world_size = check_int("world_size", world_size, minimum=1)
    rank = check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(f"Argument 'rank' must be less than world_size={world_size}, not {rank}.")
    batch_size = check_int("batch_size", batch_size, minimum=1)
    seq_len = check_int("seq_len", seq_len, minimum=2)
    seed = check_int("seed", seed, minimum=0)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    offsets = torch.randint(0, len(split.train) - seq_len, (world_size * batch_size,), generator=generator)
    mine = offsets[rank * batch_size : (rank + 1) * batch_size]
    return _windows(split.train, mine, seq_len)


def validation_batch(split: Split, n_sequences: int, seq_len: int) -> torch.Tensor:
    """The fixed ``(n_sequences, seq_len)`` validation set: evenly spaced windows."""
    n_sequences = check_int("n_sequences", n_sequences, minimum=1)
    seq_len = check_int("seq_len", seq_len, minimum=2)
    last = len(split.val) - seq_len
    if last < 0:
        raise ValueError(f"Argument 'seq_len' must be at most {len(split.val)}, not {seq_len}.")
    offsets = torch.linspace(0, last, n_sequences).long()
    return _windows(split.val, offsets, seq_len)


def _windows(tokens: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
    index = offsets.unsqueeze(1) + torch.arange(seq_len).unsqueeze(0)
    return tokens[index].long()
