"""cerar.comm.algorithms: each one-pass op of the torch path bitwise equal to the separate passes it replaces."""

from __future__ import annotations

import pytest
import torch

from cerar.comm.algorithms.cerar.decode import fold_slots, own_part, own_part_target, write_transposed
from cerar.comm.algorithms.cerar.encode import add_rounded


def _values(n: int, seed: int) -> torch.Tensor:
    """Normal values over many binades, with the float16 edge cases: overflow, subnormals, NaN."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=generator) * torch.exp2(torch.randint(-30, 17, (n,), generator=generator).float())
    x[:4] = torch.tensor([65504.0, 65520.0, 3e-8, float("nan")])
    return x


@pytest.mark.parametrize("packet", [torch.float16, torch.bfloat16])
def test_add_rounded_is_the_float32_add_rounded_once(packet: torch.dtype) -> None:
    n = 10_007
    increment = _values(n, 1)
    received = _values(n, 2).to(packet)
    wide = torch.empty(n)
    expected = torch.empty(n, dtype=packet)
    out = torch.empty(n, dtype=packet)
    for a, b in [(0, 4_000), (4_000, n)]:  # pieces, the second at an offset, as the engine sends them
        torch.add(increment[a:b], received[a:b], out=wide[a:b])
        expected[a:b].copy_(wide[a:b])
        assert add_rounded(increment[a:b], received[a:b], out[a:b]).data_ptr() == out[a:b].data_ptr()
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))  # NaN payloads too
    # Rounding twice (to the packet, then the add in it) would differ: the test can tell.
    twice = received + increment.to(packet)
    assert not torch.equal(twice[4:], expected[4:])


def test_add_rounded_with_float32_packets_is_the_add() -> None:
    increment, received = _values(1000, 3), _values(1000, 4)
    out = torch.empty(1000)
    add_rounded(increment, received, out)
    assert torch.equal(out.view(torch.int32), torch.add(received, increment).view(torch.int32))


@pytest.mark.parametrize(("data", "acc"), [(torch.float32, torch.float32), (torch.float32, torch.float64)])
def test_own_part_target_keeps_the_first_fold_bitwise(data: torch.dtype, acc: torch.dtype) -> None:
    c, w, k, scale = 8, 1_001, 3, 0.25
    generator = torch.Generator().manual_seed(5)
    rows = torch.randn(w, c, generator=generator, dtype=data)
    decode_own = torch.randn(c, c, generator=generator, dtype=data)
    weights = torch.randn(c, k, generator=generator, dtype=torch.float64).to(acc)
    arrived = torch.randn(k, w, generator=generator, dtype=acc)
    own = torch.empty(c, w, dtype=data)
    expected = torch.empty(c, w, dtype=acc)
    fold_slots(expected, arrived, weights, own_part(decode_own, rows, own), scale)  # today's path
    total = torch.full((c, w), float("nan"), dtype=acc)
    target = own_part_target(total, torch.empty(c, w, dtype=data))
    assert (target is total) == (acc == data)
    fold_slots(total, arrived, weights, own_part(decode_own, rows, target), scale)
    assert torch.equal(total, expected)


@pytest.mark.parametrize("acc", [torch.float32, torch.float64])
def test_write_transposed_is_the_transposed_copy(acc: torch.dtype) -> None:
    c, m = 8, 3_000
    generator = torch.Generator().manual_seed(6)
    totals = torch.randn(c * m, generator=generator, dtype=acc)
    totals[5] = float("inf")
    totals[7] = float("nan")
    flat, expected = torch.empty(m * c), torch.empty(m * c)
    for a, b in [(0, 1_234), (1_234, m)]:  # CerarRun's pieces: views of the flat input and sum
        total = totals[c * a : c * b].view(c, b - a)
        expected[a * c : b * c].view(b - a, c).copy_(total.t())
        out = flat[a * c : b * c].view(b - a, c)
        assert write_transposed(total, out) is out
    assert torch.equal(flat.view(torch.int32), expected.view(torch.int32))
