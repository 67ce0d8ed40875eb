"""Spreading the seam: rank-dependent input rotations.

In plain CERAR every rank's injections line up along a packet's path except across the
``N-1 -> 0`` link, where the exponent jumps by ``N``: rank ``j`` sees its predecessors through
``M_A`` and its successors through ``M_B = M_A Q^-N``, and a middle rank carries the whole
mismatch ``Q^-N - I``. Let ``Z`` rotate every node by its offset from the nearest N-th root of
unity (``Z`` commutes with ``Q`` and ``Z^N = Q^N``). If rank ``i`` encodes ``Z^i X_i`` instead
of ``X_i``, rank ``j`` sees ``N-1`` consecutive powers ``Z^(e_i)`` (``e_i = i`` for ``i < j``,
``i - N`` for ``i > j``): the mismatch is shared by all ``N`` links instead of sitting on one.
The mixed decoder inverts their mean and stays exact on the part all ranks share.

The transform folds into each rank's encoder and decoder matrices (see
:meth:`cerar.Schedule.plan`), so it costs nothing at run time. Pure numpy.
"""

from __future__ import annotations

import math

import numpy as np


def seam_offsets(nodes: np.ndarray, is_real: np.ndarray, world_size: int) -> np.ndarray:
    """Each node's offset ``rho e^(i phi)`` from the nearest N-th root of unity (complex, one
    per real node or conjugate pair). Raises ValueError when a node cannot be spread: a real
    negative node needs ``-1`` to be a root of unity (even ``N``)."""
    angles = np.angle(nodes)
    radii = np.abs(nodes)
    out = np.empty(nodes.shape, dtype=np.complex128)
    for k, (node, real) in enumerate(zip(nodes, is_real, strict=True)):
        if real:
            if node.real < 0 and world_size % 2:
                raise ValueError(
                    f"A code with a negative real node cannot spread its seam for odd world_size={world_size}."
                )
            out[k] = radii[k]
        else:
            root = 2 * math.pi * round(angles[k] * world_size / (2 * math.pi)) / world_size
            out[k] = radii[k] * np.exp(1j * (angles[k] - root))
    return out


def exponents(world_size: int, rank: int) -> list[int]:
    """``e_i`` for every other rank ``i`` in ring order (``i < j``: ``i``; ``i > j``: ``i - N``)."""
    return [i if i < rank else i - world_size for i in range(world_size) if i != rank]


def transform(offsets: np.ndarray, is_real: np.ndarray, power: int) -> np.ndarray:
    """``Z^power`` in the rows' real block form (``c x c``).

    A pair's columns hold ``(Re z^n, Im z^n)``; right-multiplying a row by the complex scalar
    ``zeta`` maps them by ``[[Re, Im], [-Im, Re]]``.
    """
    zeta = offsets.astype(np.complex128) ** power
    c = int(np.sum(np.where(is_real, 1, 2)))
    out = np.zeros((c, c))
    index = 0
    for value, real in zip(zeta, is_real, strict=True):
        if real:
            out[index, index] = value.real
            index += 1
        else:
            out[index : index + 2, index : index + 2] = [[value.real, value.imag], [-value.imag, value.real]]
            index += 2
    return out
