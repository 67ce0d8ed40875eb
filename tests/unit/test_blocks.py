"""The block-quantized formats (cerar.coding.blocks: int8, e4m3fn, packed int4) and their ring's simulator."""

from __future__ import annotations

import numpy as np
import pytest

from cerar.coding.blocks import (
    DEFAULT_BLOCK,
    QMAX,
    BlockFormat,
    code_bytes,
    dequantize,
    fp8_decode,
    fp8_encode,
    pack_int4,
    quantize,
    ring_error_bound,
    round_trip,
    unpack_int4,
)
from cerar.protocol.simulate_ring import ring_bytes_per_value, simulate_ring

#: Hand-checked float8_e4m3fn codes: (value, code). Subnormals are multiples of 2^-9; ties go to
#: the even code.
FP8_CASES = [
    (0.0, 0x00),
    (-0.0, 0x80),
    (2.0**-9, 0x01),  # smallest subnormal
    (2.0**-10, 0x00),  # half of it: a tie between 0 and 0x01, to the even 0
    (3 * 2.0**-10, 0x02),  # a tie between 0x01 and 0x02
    (7 * 2.0**-9, 0x07),  # largest subnormal
    (2.0**-6, 0x08),  # smallest normal
    (1.0, 0x38),
    (-1.0, 0xB8),
    (1.0625, 0x38),  # a tie between 1.0 (0x38) and 1.125 (0x39)
    (1.1875, 0x3A),  # a tie between 1.125 (0x39) and 1.25 (0x3A)
    (240.0, 0x77),
    (384.0, 0x7C),
    (400.0, 0x7C),  # a tie between 384 (0x7C) and 416 (0x7D)
    (432.0, 0x7E),  # a tie between 416 (0x7D) and 448 (0x7E)
    (448.0, 0x7E),  # the largest
    (-448.0, 0xFE),
    (1000.0, 0x7E),  # saturates
]


@pytest.mark.parametrize(("value", "code"), FP8_CASES)
def test_fp8_codes_by_hand(value: float, code: int) -> None:
    assert int(fp8_encode(np.array([value], dtype=np.float32))[0]) == code


def test_fp8_nan_and_table() -> None:
    assert int(fp8_encode(np.array([np.nan], dtype=np.float32))[0]) & 0x7F == 0x7F
    assert np.isnan(fp8_decode(np.array([0x7F, 0xFF], dtype=np.uint8))).all()
    finite = fp8_decode(np.arange(256, dtype=np.uint8))
    finite = finite[np.isfinite(finite)]
    assert len(finite) == 254 and finite.max() == 448.0 and finite.min() == -448.0
    codes = np.arange(256, dtype=np.uint8)
    keep = (codes & 0x7F) != 0x7F
    assert np.array_equal(fp8_encode(fp8_decode(codes[keep])), codes[keep])  # every value is its own code


def test_fp8_matches_torch_when_available() -> None:
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8_e4m3fn")
    rng = np.random.default_rng(0)
    values = fp8_decode(np.arange(127, dtype=np.uint8)).astype(np.float64)
    mids = (values[1:] + values[:-1]) / 2
    x = np.concatenate([mids, -mids, rng.uniform(-448, 448, 20000), 1e-3 * rng.standard_normal(5000)])
    x = x.astype(np.float32)
    theirs = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(fp8_encode(x), theirs)


def test_format_defaults_and_validation() -> None:
    fmt = BlockFormat()
    assert (fmt.wire, fmt.block, fmt.scale) == ("int8", 64, "bf16")
    assert fmt.bytes_per_value == 1 + 2 / 64
    assert BlockFormat("fp8", 32, "fp32").bytes_per_value == 1.125
    assert "int8" in fmt.describe() and "64" in fmt.describe()
    with pytest.raises(ValueError, match=r"'wire'.*'int1'"):
        BlockFormat("int1")
    # int4: the measured default block (32), half a byte a code, even blocks only
    assert BlockFormat("int4") == BlockFormat("int4", DEFAULT_BLOCK["int4"], "bf16") == BlockFormat("int4", 32)
    assert BlockFormat("int8") == BlockFormat("int8", 64, "bf16") and BlockFormat("fp8").block == 64
    assert BlockFormat("int4", 32, "bf16").bytes_per_value == 0.5 + 2 / 32
    assert BlockFormat("int4", 8, "fp32").bytes_per_value == 1.0
    with pytest.raises(ValueError, match=r"'block'.*even.*33"):
        BlockFormat("int4", 33)
    with pytest.raises(ValueError, match=r"'block'.*0"):
        BlockFormat("int4", 0)
    with pytest.raises(ValueError, match=r"'block'.*0"):
        BlockFormat(block=0)
    with pytest.raises(TypeError, match="'block'"):
        BlockFormat(block=32.0)
    with pytest.raises(ValueError, match=r"'scale'.*'fp8'"):
        BlockFormat(scale="fp8")


def test_int8_rounds_half_to_even() -> None:
    fmt = BlockFormat("int8", 8, "fp32")
    x = np.array([127, 2.5, 3.5, -2.5, -0.5, 126.6, 0, 1], dtype=np.float32)  # absmax 127: s = 1
    codes, scales = quantize(x, fmt)
    assert codes.dtype == np.int8 and scales.tolist() == [1.0]
    assert codes.tolist() == [127, 2, 4, -2, 0, 127, 0, 1]
    assert np.array_equal(dequantize(codes, scales, fmt, 8), codes.astype(np.float32))


def test_int4_rounds_half_to_even_and_clamps() -> None:
    fmt = BlockFormat("int4", 8, "fp32")
    x = np.array([7, 2.5, 3.5, -2.5, -0.5, 6.5, -6.5, 0.5], dtype=np.float32)  # absmax 7: s = 1
    codes, scales = quantize(x, fmt)
    assert codes.dtype == np.int8 and scales.tolist() == [1.0]
    assert codes.tolist() == [7, 2, 4, -2, 0, 6, -6, 0]
    assert np.array_equal(dequantize(codes, scales, fmt, 8), codes.astype(np.float32))
    # a bfloat16 scale that rounds down (3/7 -> 0.4277): 3 / s = 7.01 is clamped to 7
    codes, scales = quantize(np.float32([3, -3]), BlockFormat("int4", 2, "bf16"))
    assert scales[0] < np.float32(3) / np.float32(7) and codes.tolist() == [7, -7]


def test_int4_packing() -> None:
    codes = np.int8([1, -1, 7, -7, -8, 0, 3])
    packed = pack_int4(codes)
    assert packed.tolist() == [0xF1, 0x97, 0x08, 0x03]  # low nibble first; the odd count's pad is 0
    assert np.array_equal(unpack_int4(packed, 7), codes)
    assert np.array_equal(code_bytes(codes, BlockFormat("int4", 8)), packed)
    assert code_bytes(np.int8([-1]), BlockFormat("int8", 8)).tolist() == [0xFF]
    every = np.arange(256, dtype=np.uint8)
    assert np.array_equal(pack_int4(unpack_int4(every, 512)), every)  # every byte, both ways
    assert pack_int4(np.zeros((2, 0), dtype=np.int8)).shape == (2, 0)
    with pytest.raises(ValueError, match="'packed'"):
        unpack_int4(packed, 9)


def test_fp8_block_round_trip() -> None:
    fmt = BlockFormat("fp8", 4, "fp32")
    x = np.array([448, 1.0625, 3 * 2.0**-10, -432], dtype=np.float32)  # absmax 448: s = 1
    codes, _ = quantize(x, fmt)
    assert codes.dtype == np.uint8 and codes.tolist() == [0x7E, 0x38, 0x02, 0xFE]
    assert round_trip(x, fmt).tolist() == [448.0, 1.0, 2.0**-8, -448.0]


def test_zeros_and_one_huge_value() -> None:
    fmt = BlockFormat("int8", 4, "fp32")
    x = np.array([0, 0, 0, 0, 1e30, 1, -1, 2, 1, 2, 3, 4], dtype=np.float32)
    codes, scales = quantize(x, fmt)
    assert scales[0] == 0 and codes[:4].tolist() == [0, 0, 0, 0]
    back = dequantize(codes, scales, fmt, 12)
    assert back[:4].tolist() == [0, 0, 0, 0]
    assert back[5:8].tolist() == [0, 0, 0]  # swamped by the block's huge value
    assert abs(back[4] - 1e30) <= 1e30 / 254
    assert np.allclose(back[8:], x[8:], atol=4 / 254)  # the next block is not affected


@pytest.mark.parametrize("wire", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_spreads_to_its_block_only(wire: str, bad: float) -> None:
    fmt = BlockFormat(wire, 4, "bf16")
    x = np.arange(1, 13, dtype=np.float32)
    x[5] = bad
    codes, scales = quantize(x, fmt)
    assert not np.isfinite(scales[1]) and (codes[4:8].astype(np.int64) == 0).all()
    back = dequantize(codes, scales, fmt, 12)
    assert np.isnan(back[4:8]).all()
    assert np.isfinite(back[:4]).all() and np.isfinite(back[8:]).all()


@pytest.mark.parametrize("wire", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("scale", ["fp32", "fp16", "bf16"])
def test_short_last_block_is_zero_padded(wire: str, scale: str) -> None:
    fmt = BlockFormat(wire, 32, scale)
    x = np.random.default_rng(1).standard_normal(100).astype(np.float32)
    codes, scales = quantize(x, fmt)
    assert codes.shape == (100,) and scales.shape == (4,)
    padded = np.zeros(128, dtype=np.float32)
    padded[:100] = x
    codes_p, scales_p = quantize(padded, fmt)
    assert np.array_equal(codes, codes_p[:100]) and np.array_equal(scales, scales_p)
    assert np.array_equal(round_trip(x, fmt), round_trip(padded, fmt)[:100])
    # Rows quantize independently, as the same vector alone.
    two = np.stack([x, -x])
    assert np.array_equal(round_trip(two, fmt)[1], round_trip(-x, fmt))


def test_scales_are_rounded_to_their_dtype() -> None:
    x = np.array([1.0, 0.3], dtype=np.float32)
    for scale, dtype in (("fp16", np.float16), ("bf16", None)):
        _, scales = quantize(x, BlockFormat("int8", 2, scale))
        s = np.float32(1.0) / np.float32(127.0)
        if dtype is not None:
            assert scales[0] == np.float32(np.float16(s))
        else:
            assert scales[0].view(np.uint32) & 0xFFFF == 0 and abs(scales[0] / s - 1) <= 2.0**-8
    # A float16 scale flushes a tiny block to zero, where a bfloat16 one still holds it.
    tiny = np.full(4, 1e-7, dtype=np.float32)
    assert (round_trip(tiny, BlockFormat("int8", 4, "fp16")) == 0).all()
    assert np.allclose(round_trip(tiny, BlockFormat("int8", 4, "bf16")), tiny, rtol=1e-2)


@pytest.mark.parametrize(("wire", "coarse", "zero"), [("int8", 1.7e-38, 5e-39), ("int4", 1e-40, 3e-40)])
def test_bfloat16_scales_have_a_smaller_range_than_float32(wire: str, coarse: float, zero: float) -> None:
    """The docstring's range: a bfloat16 scale goes subnormal below ``QMAX 1.2e-38`` (coarse
    blocks) and rounds to 0 below ``QMAX 4.6e-41`` (zero blocks); float32 scales keep them."""
    g = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    g /= np.abs(g).max()

    def error(level: float, scale: str) -> float:
        x = (g * np.float32(level)).astype(np.float32)
        back = round_trip(x, BlockFormat(wire, 64, scale)).astype(np.float64)
        return float(np.linalg.norm(back - x) / np.linalg.norm(x.astype(np.float64)))

    normal = error(1.0, "bf16")
    assert error(1e-30, "bf16") < 1.25 * normal  # a normal scale: only its own rounding differs
    assert error(zero * 0.9, "bf16") == 1.0  # the block comes back zero
    assert error(zero * 0.9, "fp32") < 1.25 * error(1.0, "fp32")
    if wire == "int8":
        assert error(coarse, "bf16") > 5 * normal  # a subnormal scale of two bits


def test_constant_blocks_carry_the_scales_rounding() -> None:
    """All ones at N = 3: the scale 1/127 rounds in bfloat16, and every value carries it."""
    ones = np.ones((3, 10), dtype=np.float32)
    total = simulate_ring(ones, "int8", block_format=BlockFormat("int8", 64, "bf16")).outputs[0]
    assert np.all(total == total[0]) and 3.007 < total[0] < 3.008


def test_dequantize_checks_shapes() -> None:
    fmt = BlockFormat("int8", 4, "fp32")
    codes, scales = quantize(np.ones(6, dtype=np.float32), fmt)
    with pytest.raises(ValueError, match="'codes'"):
        dequantize(codes, scales, fmt, 5)
    with pytest.raises(ValueError, match="'scales'"):
        dequantize(codes, scales[:1], fmt, 6)


@pytest.mark.parametrize("wire", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("world_size", [4, 8])
@pytest.mark.parametrize("block", [32, 256])
def test_ring_identical_on_all_ranks_and_within_bound(wire: str, world_size: int, block: int) -> None:
    fmt = BlockFormat(wire, block, "bf16")
    x = np.random.default_rng(world_size).standard_normal((world_size, 20000)).astype(np.float32)
    result = simulate_ring(x, wire, block_format=fmt)
    assert all(np.array_equal(result.outputs[0], row) for row in result.outputs[1:])
    error = result.worst_relative_error
    bound = ring_error_bound(world_size, fmt)
    assert 0.4 * bound < error <= bound
    assert ring_bytes_per_value(world_size, wire, fmt) == 2 * (world_size - 1) / world_size * fmt.bytes_per_value


def test_ring_each_hop_requantizes_and_owner_keeps_its_packet() -> None:
    # N = 2: rank 0's chunk 0 is rounded, added to rank 1's (its owner), and the sum rounded once more.
    fmt = BlockFormat("int8", 2, "fp32")
    x = np.array([[1.0, 0.3, 5.0, 7.0], [0.5, 0.25, 1.0, 2.0]], dtype=np.float32)
    result = simulate_ring(x, "int8", block_format=fmt)
    partial = x[1, :2] + round_trip(x[0, :2], fmt)
    assert np.array_equal(result.outputs[0, :2], round_trip(partial, fmt))
    assert np.array_equal(result.outputs[0], result.outputs[1])


def test_ring_arguments() -> None:
    x = np.ones((4, 10))
    with pytest.raises(ValueError, match="'block_format'"):
        simulate_ring(x, "fp16", block_format=BlockFormat())
    with pytest.raises(TypeError, match="'block_format'"):
        simulate_ring(x, "int8", block_format="int8")
    # The block format's wire is the one asked for.
    a = simulate_ring(x, "fp8", block_format=BlockFormat("int8", 8, "fp32"))
    b = simulate_ring(x, "fp8", block_format=BlockFormat("fp8", 8, "fp32"))
    assert np.array_equal(a.outputs, b.outputs)
    assert ring_error_bound(4) == ring_error_bound(4, BlockFormat())
    assert ring_error_bound(4, BlockFormat("fp8")) > ring_error_bound(4, BlockFormat("int8")) > 0
    assert ring_error_bound(4, BlockFormat("int4")) > ring_error_bound(4, BlockFormat("fp8"))
    assert QMAX == {"int8": 127.0, "fp8": 448.0, "int4": 7.0, "int3": 3.0, "int2": 1.0}
