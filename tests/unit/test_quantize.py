"""The block-quantized ring's quantization (int8, e4m3fn, packed int4): the torch ops
(cerar.comm.algorithms.ring.quantize) against the numpy reference of the format (cerar.coding.blocks), and
the compiled kernels (cerar.comm.algorithms.native) against the torch ops, bit for bit (a NaN matches
any NaN: its payload is each one's own)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from cerar.coding import blocks
from cerar.coding.blocks import BlockFormat
from cerar.comm.algorithms import native
from cerar.comm.algorithms.ring import quantize as q8

#: The wires the compiled kernels take (int3 and int2 have torch ops only: tests/unit/test_low_wires.py).
COMPILED_WIRES = tuple(wire for wire in blocks.WIRES if wire in native.QUANT_WIRES)
#: Block sizes per wire: 1, an odd one and 64; int4's blocks are even (2, 6, 64).
TEST_BLOCKS = {"int8": (1, 7, 64), "fp8": (1, 7, 64), "int4": (2, 6, 64)}
FORMATS = [
    BlockFormat(wire, block, scale)
    for wire in COMPILED_WIRES
    for scale in blocks.SCALE_DTYPES
    for block in TEST_BLOCKS[wire]
]
KINDS = ("normal", "heavy", "zero", "tiny", "huge", "nonfinite", "mixed")
LENGTHS = (1, 6, 7, 64, 65, 1000)  # odd lengths: int4's last nibble is a pad


def _ids(fmt: BlockFormat) -> str:
    return f"{fmt.wire}-{fmt.scale}-B{fmt.block}"


def _values(kind: str, m: int, seed: int) -> torch.Tensor:
    """``m`` float32 values of one of the kinds the format must treat exactly."""
    g = np.random.default_rng(seed)
    if kind == "normal":
        x = g.standard_normal(m)
    elif kind == "heavy":  # Student's t with 1.5 degrees of freedom, over many binades
        x = g.standard_t(1.5, m) * 2.0 ** g.integers(-20, 20, m)
    elif kind == "zero":
        x = np.zeros(m)
    elif kind == "tiny":  # float32 subnormals and just above: scales that round to 0 in fp16
        x = g.standard_normal(m) * 2.0 ** g.integers(-149, -110, m)
    elif kind == "huge":  # beyond float16's scale range, near float32's end
        x = g.standard_normal(m) * 2.0 ** g.integers(100, 126, m)
    elif kind == "nonfinite":
        x = g.standard_normal(m)
        x[g.integers(0, m, max(1, m // 50))] = np.nan
        x[g.integers(0, m, max(1, m // 50))] = np.inf
        x[g.integers(0, m, max(1, m // 50))] = -np.inf
    else:  # everything at once, and signed zeros
        x = g.standard_normal(m) * 2.0 ** g.integers(-140, 120, m)
        x[g.integers(0, m, max(1, m // 10))] = 0.0
        x[g.integers(0, m, max(1, m // 10))] = -0.0
        x[g.integers(0, m, max(1, m // 100))] = np.nan
    return torch.from_numpy(x.astype(np.float32))


def _same(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> bool:
    """Bitwise equal float32 arrays, any NaN matching any NaN."""
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    equal = (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))
    return a.shape == b.shape and bool(equal.all())


def _unpack(packet: torch.Tensor, m: int, fmt: BlockFormat) -> tuple[np.ndarray, np.ndarray]:
    """A packet's ``(codes as the reference gives them, scales as float32)``; for int4 the packed
    bytes must also be the reference's, pad nibble included."""
    scales = q8._scales(packet, m, fmt).numpy()
    codes = q8._codes(packet, m, fmt).view(torch.uint8).numpy()
    if fmt.wire == "int4":
        assert codes.shape == (-(-m // 2),)
        unpacked = blocks.unpack_int4(codes, m)
        assert np.array_equal(blocks.pack_int4(unpacked), codes)  # an odd m's pad nibble is 0
        return unpacked, scales
    return (codes.view(np.int8) if fmt.wire == "int8" else codes), scales


def _code_bytes(packet: torch.Tensor, m: int, fmt: BlockFormat) -> torch.Tensor:
    return q8._codes(packet, m, fmt).view(torch.uint8)


def _packet(m: int, fmt: BlockFormat, offset: int = 0) -> torch.Tensor:
    """A packet's buffer, ``offset`` bytes into a larger one (filled with garbage)."""
    size = q8.packet_bytes(m, fmt)
    return torch.full((size + offset,), 0xA5, dtype=torch.uint8)[offset:]


def _reference_quantize(x: torch.Tensor, fmt: BlockFormat) -> tuple[np.ndarray, np.ndarray]:
    codes, scales = blocks.quantize(x.numpy(), fmt)
    return (codes.view(np.uint8) if fmt.wire == "fp8" else codes), scales


def _kernels(fmt: BlockFormat) -> native.QuantKernels:
    if shutil.which("cc") is None and shutil.which("gcc") is None and shutil.which("clang") is None:
        pytest.skip("no C compiler: the torch ops run instead")
    kernels = native.quant_kernels(fmt.wire, fmt.scale, fmt.block, torch.float32, torch.device("cpu"))
    assert kernels is not None, native.status()  # a compiler is here: the build must work
    return kernels


# ---------------------------------------------------------------------------------------------
# The torch ops against the numpy reference


@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
@pytest.mark.parametrize("kind", KINDS)
def test_quantize_matches_the_reference(fmt: BlockFormat, kind: str) -> None:
    for seed, m in enumerate(LENGTHS):
        x = _values(kind, m, seed)
        packet = _packet(m, fmt)
        q8.quantize_into(x, packet, fmt)
        codes, scales = _unpack(packet, m, fmt)
        ref_codes, ref_scales = _reference_quantize(x, fmt)
        assert _same(scales, ref_scales), (m, scales, ref_scales)
        assert np.array_equal(codes, ref_codes), (m, np.flatnonzero(codes != ref_codes)[:10])


@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_and_the_fused_hop_match_the_reference(fmt: BlockFormat, kind: str) -> None:
    for seed, m in enumerate(LENGTHS):
        x, own = _values(kind, m, seed), _values("normal", m, seed + 100)
        arrived = _packet(m, fmt)
        q8.quantize_into(x, arrived, fmt)
        codes, scales = _reference_quantize(x, fmt)
        expected = blocks.dequantize(codes, scales, fmt, m)
        out = torch.full((m,), 7.0)
        q8.dequantize_into(out, arrived, fmt)
        assert _same(out, expected)
        acc = own.clone()
        q8.dequantize_add_(acc, arrived, fmt)
        partial = own.numpy() + expected  # float32 + float32: the reference's float32 sum
        assert _same(acc, partial)
        for keep in (False, True):
            mine, sent = own.clone(), _packet(m, fmt, offset=3)
            q8.dequant_add_requant(mine, arrived, sent, fmt, keep=keep)
            ref_codes, ref_scales = blocks.quantize(partial, fmt)
            codes_out, scales_out = _unpack(sent, m, fmt)
            assert _same(scales_out, ref_scales)
            assert np.array_equal(codes_out, ref_codes.view(np.uint8) if fmt.wire == "fp8" else ref_codes)
            kept = blocks.dequantize(ref_codes, ref_scales, fmt, m) if keep else partial
            assert _same(mine, kept)


@pytest.mark.parametrize("wire", COMPILED_WIRES)
def test_rounding_ties_and_every_code(wire: str) -> None:
    """A block whose absmax is QMAX has scale 1 (exact in every scale dtype), so its codes are its
    values rounded: every code, every tie between neighbours and the values beside each tie (for
    int4 the half steps ``+-0.5 .. +-6.5`` and ``+-7`` itself)."""
    top = blocks.QMAX[wire]
    if wire != "fp8":
        grid = np.arange(-top, top + 1, dtype=np.float32)
    else:
        grid = blocks.FP8_VALUES[np.isfinite(blocks.FP8_VALUES)]
    grid = np.unique(grid)
    ties = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(ties, np.float32(-np.inf)), np.nextafter(ties, np.float32(np.inf))])
    values = np.concatenate([grid, ties, near, -ties, -near, np.float32([-0.0, 1e-30, -1e-30])])
    block = 64 if wire == "int4" else 63
    for scale in blocks.SCALE_DTYPES:
        fmt = BlockFormat(wire, block, scale)
        step = block - 1
        chunks = [np.concatenate([[top], values[i : i + step]]) for i in range(0, len(values), step)]
        x = torch.from_numpy(np.concatenate(chunks).astype(np.float32))
        packet = _packet(x.numel(), fmt)
        q8.quantize_into(x, packet, fmt)
        codes, scales = _unpack(packet, x.numel(), fmt)
        assert np.all(scales == 1.0)
        ref_codes, _ = _reference_quantize(x, fmt)
        assert np.array_equal(codes, ref_codes)
        if shutil.which("cc"):
            compiled = _packet(x.numel(), fmt)
            _kernels(fmt).quantize(x, compiled)
            assert torch.equal(compiled, packet)


@pytest.mark.parametrize("scale", blocks.SCALE_DTYPES)
def test_every_code_dequantizes_as_the_reference(scale: str) -> None:
    """All 256 bytes (the e4m3fn NaNs included; for int4 every pair of nibbles, -8 included), by a
    scale of 1 and of 0.75, through the torch ops and the compiled kernels."""
    for wire in COMPILED_WIRES:
        m = 512 if wire == "int4" else 256
        fmt = BlockFormat(wire, m, scale)
        codes = np.arange(256, dtype=np.uint8)
        for value in (1.0, 0.75):
            raw = torch.tensor([value], dtype=q8.scale_dtype(fmt)).view(torch.uint8)
            packet = torch.cat([raw, torch.from_numpy(codes)])
            given = codes.view(np.int8) if wire == "int8" else codes
            if wire == "int4":
                given = blocks.unpack_int4(codes, m)
            expected = blocks.dequantize(given, np.float32([value]), fmt, m)
            out = torch.empty(m)
            q8.dequantize_into(out, packet, fmt)
            assert _same(out, expected)
            if shutil.which("cc"):
                _kernels(fmt).dequantize(packet, out)
                assert _same(out, expected)


@pytest.mark.parametrize("wire", COMPILED_WIRES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_block_sums_spread_nonfinite_within_their_block_only(wire: str, bad: float) -> None:
    fmt = BlockFormat(wire, 8, "bf16")
    x = torch.randn(63)  # odd: int4's last block ends on a pad nibble
    x[19] = bad
    packet = _packet(63, fmt)
    q8.quantize_into(x, packet, fmt)
    out = torch.empty(63)
    q8.dequantize_into(out, packet, fmt)
    assert torch.isnan(out[16:24]).all() and torch.isfinite(out[:16]).all() and torch.isfinite(out[24:]).all()
    assert (_code_bytes(packet, 63, fmt)[fmt.code_bytes(16) : fmt.code_bytes(24)] == 0).all()  # codes 0
    compiled = _packet(63, fmt)
    _kernels(fmt).quantize(x, compiled)
    assert torch.equal(compiled[fmt.blocks(63) * 2 :], packet[fmt.blocks(63) * 2 :])


# ---------------------------------------------------------------------------------------------
# int4 packing by hand: nibble order, signs, pad, zeros, ties, the clamp


def _int4_packet(x: list[float], fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``(torch ops' packet, compiled kernels' packet)`` of ``x``, checked equal to each other."""
    values = torch.tensor(x, dtype=torch.float32)
    packet, compiled = _packet(len(x), fmt), _packet(len(x), fmt, offset=1)
    q8.quantize_into(values, packet, fmt)
    _kernels(fmt).quantize(values, compiled)
    assert torch.equal(packet, compiled)
    return packet, values


def test_int4_nibbles_by_hand() -> None:
    fmt = BlockFormat("int4", 6, "fp32")
    # absmax 7: scale 1, the codes are the values rounded half to even
    packet, _ = _int4_packet([1, -1, 7, -7, 3, 0.5, 6.5, -6.5, 5.5, -7, 1.5], fmt)
    assert q8._scales(packet, 11, fmt).tolist() == [1.0, 1.0]
    # codes 1 -1 | 7 -7 | 3 0 | 6 -6 | 6 -7 | 2 (pad 0): low nibble first, two's complement
    expected = [0xF1, 0x97, 0x03, 0xA6, 0x96, 0x02]
    assert _code_bytes(packet, 11, fmt).tolist() == expected
    assert blocks.pack_int4(np.int8([1, -1, 7, -7, 3, 0, 6, -6, 6, -7, 2])).tolist() == expected
    out = torch.empty(11)
    q8.dequantize_into(out, packet, fmt)
    assert out.tolist() == [1, -1, 7, -7, 3, 0, 6, -6, 6, -7, 2]


def test_int4_zeros_ties_and_the_clamp() -> None:
    fmt = BlockFormat("int4", 4, "bf16")
    # a zero block; a block at scale 1 with every half step beside 7; a block whose bfloat16 scale
    # rounds down (3/7 = 0.42857 -> 0.427734375), so 3 / s = 7.0137 is clamped to 7
    x = [0, 0, 0, 0, 7, 6.5, -6.5, -7, 3, -3, 1.5, 0]
    packet, _ = _int4_packet(x, fmt)
    scales = q8._scales(packet, 12, fmt)
    assert scales[0] == 0 and scales[1] == 1 and scales[2] < 3 / 7
    codes = blocks.unpack_int4(_code_bytes(packet, 12, fmt).numpy(), 12)
    assert codes.tolist() == [0, 0, 0, 0, 7, 6, -6, -7, 7, -7, 4, 0]
    ref_codes, ref_scales = blocks.quantize(np.float32(x), fmt)
    assert np.array_equal(codes, ref_codes) and _same(scales, ref_scales)
    out = torch.empty(12)
    q8.dequantize_into(out, packet, fmt)
    assert out[:4].tolist() == [0, 0, 0, 0] and out[4:8].tolist() == [7, 6, -6, -7]


def test_int4_short_last_block_and_odd_pieces() -> None:
    """A vector of odd length whose last block is short and odd: its pad nibble is 0, and the packet
    is the zero-padded vector's packet cut at the last byte it needs."""
    fmt = BlockFormat("int4", 8, "bf16")
    x = _values("normal", 21, 3)
    packet, _ = _int4_packet(x.tolist(), fmt)
    assert packet.numel() == q8.packet_bytes(21, fmt) == 3 * 2 + 11
    assert int(_code_bytes(packet, 21, fmt)[-1]) >> 4 == 0
    padded = torch.cat([x, torch.zeros(3)])
    whole = _packet(24, fmt)
    q8.quantize_into(padded, whole, fmt)
    assert torch.equal(_code_bytes(whole, 24, fmt)[:11], _code_bytes(packet, 21, fmt))
    assert torch.equal(whole[:6], packet[:6])


def test_int4_refuses_odd_blocks() -> None:
    with pytest.raises(ValueError, match=r"'block'.*even.*7"):
        BlockFormat("int4", 7, "bf16")
    cpu = torch.device("cpu")
    assert native.quant_kernels("int4", "bf16", 8, torch.float32, cpu) is not None or native.status().startswith("off")
    assert native.quant_kernels("int4", "bf16", 7, torch.float32, cpu) is None  # the C refuses it too


# ---------------------------------------------------------------------------------------------
# The compiled kernels against the torch ops


@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_kernels_match_the_torch_ops(fmt: BlockFormat, kind: str) -> None:
    kernels = _kernels(fmt)
    for seed, m in enumerate((*LENGTHS, 4099)):
        x, own = _values(kind, m, seed), _values("mixed" if kind == "mixed" else "normal", m, seed + 100)
        theirs, mine = _packet(m, fmt), _packet(m, fmt, offset=1)  # the C reads and writes bytes unaligned
        q8.quantize_into(x, theirs, fmt)
        kernels.quantize(x, mine)
        assert _same(q8._scales(mine, m, fmt), q8._scales(theirs, m, fmt))
        assert torch.equal(_code_bytes(mine, m, fmt), _code_bytes(theirs, m, fmt))
        for accumulate in (False, True):
            a, b = own.clone(), own.clone()
            if accumulate:
                q8.dequantize_add_(a, theirs, fmt)
            else:
                q8.dequantize_into(a, theirs, fmt)
            kernels.dequantize(mine, b, accumulate)
            assert _same(a, b)
        for keep in (False, True):
            a, b = own.clone(), own.clone()
            out_a, out_b = _packet(m, fmt), _packet(m, fmt, offset=2)
            q8.dequant_add_requant(a, theirs, out_a, fmt, keep=keep)
            kernels.dequant_add_requant(b, mine, out_b, keep)
            assert _same(a, b)
            assert _same(q8._scales(out_a, m, fmt), q8._scales(out_b, m, fmt))
            assert torch.equal(_code_bytes(out_a, m, fmt), _code_bytes(out_b, m, fmt))


@pytest.mark.parametrize("scale", blocks.SCALE_DTYPES)
def test_scales_round_alike_over_every_binade(scale: str) -> None:
    """Blocks of one value, so that each value has its own scale ``|x| / QMAX``: random mantissas at
    every float32 exponent (subnormals, float16's subnormal scales and its overflow, bfloat16's
    rounding up to infinity), through the reference, the torch ops and the compiled kernels."""
    g = np.random.default_rng(5)
    bits = (g.integers(0, 255, 200_000, dtype=np.uint32) << 23) | g.integers(0, 1 << 23, 200_000, dtype=np.uint32)
    x = torch.from_numpy(bits.view(np.float32) * np.where(g.random(200_000) < 0.5, -1, 1).astype(np.float32))
    for wire in COMPILED_WIRES:
        fmt = BlockFormat(wire, 2 if wire == "int4" else 1, scale)  # int4: pairs share a scale
        packet = _packet(x.numel(), fmt)
        q8.quantize_into(x, packet, fmt)
        codes, scales = _unpack(packet, x.numel(), fmt)
        ref_codes, ref_scales = _reference_quantize(x, fmt)
        assert _same(scales, ref_scales) and np.array_equal(codes, ref_codes)
        compiled = _packet(x.numel(), fmt)
        _kernels(fmt).quantize(x, compiled)
        assert torch.equal(compiled, packet)


def test_the_compiled_kernels_are_declined_where_they_do_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert native.quant_kernels(torch.int8, "fp32", 64, torch.float64, cpu) is None
    assert native.quant_kernels(torch.int8, "fp32", 64, torch.float32, torch.device("meta")) is None
    assert native.quant_kernels(torch.uint8, "fp32", 64, torch.float32, cpu) is None
    assert native.quant_kernels(torch.int8, "fp64", 64, torch.float32, cpu) is None
    assert native.quant_kernels("int2", "fp32", 64, torch.float32, cpu) is None
    monkeypatch.setenv("CERAR_NATIVE", "0")
    assert native.quant_kernels(torch.int8, "fp32", 64, torch.float32, cpu) is None
    assert native.status() == "off: CERAR_NATIVE=0"


def test_status_names_the_quantize_kernels() -> None:
    _kernels(BlockFormat())
    assert native.status().startswith("on: ") and "quantize" in native.status()


def test_packet_bytes_and_bytes_per_value() -> None:
    fmt = BlockFormat("fp8", 64, "fp16")
    assert q8.packet_bytes(640, fmt) == 640 * fmt.bytes_per_value
    assert q8.packet_bytes(65, fmt) == 2 * 2 + 65
    assert q8.packet_bytes(0, fmt) == 0
    fmt4 = BlockFormat("int4", 32, "bf16")
    assert q8.packet_bytes(640, fmt4) == 640 * fmt4.bytes_per_value == 20 * 2 + 320
    assert q8.packet_bytes(65, fmt4) == 3 * 2 + 33


# ---------------------------------------------------------------------------------------------
# On CUDA: the same bits as on the CPU, and no host synchronisation


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize(
    "fmt",
    [
        BlockFormat("int8", 64, "bf16"),
        BlockFormat("fp8", 32, "fp32"),
        BlockFormat("int8", 7, "fp16"),
        BlockFormat("int4", 32, "bf16"),
        BlockFormat("int4", 6, "fp16"),
    ],
    ids=_ids,
)
def test_cuda_ops_match_the_cpu_without_a_host_sync(fmt: BlockFormat) -> None:
    m = 100_003
    x, own = _values("mixed", m, 1), _values("normal", m, 2)
    cpu_packet, cpu_out = _packet(m, fmt), _packet(m, fmt)
    cpu_own = own.clone()
    q8.quantize_into(x, cpu_packet, fmt)
    q8.dequant_add_requant(cpu_own, cpu_packet, cpu_out, fmt, keep=True)
    device = torch.device("cuda")
    gx, gown = x.to(device), own.to(device)
    gpacket = torch.empty(q8.packet_bytes(m, fmt), dtype=torch.uint8, device=device)
    gout = torch.empty_like(gpacket)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        q8.quantize_into(gx, gpacket, fmt)
        q8.dequant_add_requant(gown, gpacket, gout, fmt, keep=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert _same(q8._scales(gpacket.cpu(), m, fmt), q8._scales(cpu_packet, m, fmt))
    assert torch.equal(_code_bytes(gpacket.cpu(), m, fmt), _code_bytes(cpu_packet, m, fmt))
    assert torch.equal(_code_bytes(gout.cpu(), m, fmt), _code_bytes(cpu_out, m, fmt))
    assert _same(gown.cpu(), cpu_own)
