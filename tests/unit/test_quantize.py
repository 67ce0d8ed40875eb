"""The 8-bit ring's block quantization: the torch ops (cerar.comm.kernels.quantize) against the numpy
reference of the format (cerar.coding.blocks), and the compiled kernels (cerar.comm.kernels.native)
against the torch ops, bit for bit (a NaN matches any NaN: its payload is each one's own)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from cerar.coding import blocks
from cerar.coding.blocks import BlockFormat
from cerar.comm.kernels import native
from cerar.comm.kernels import quantize as q8

FORMATS = [
    BlockFormat(wire, block, scale) for wire in blocks.WIRES for scale in blocks.SCALE_DTYPES for block in (1, 7, 64)
]
KINDS = ("normal", "heavy", "zero", "tiny", "huge", "nonfinite", "mixed")
LENGTHS = (1, 6, 64, 65, 1000)


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
    """A packet's ``(codes as the reference gives them, scales as float32)``."""
    scales = q8._scales(packet, m, fmt).numpy()
    codes = q8._codes(packet, m, fmt).view(torch.uint8).numpy()
    return (codes.view(np.int8) if fmt.wire == "int8" else codes), scales


def _code_bytes(packet: torch.Tensor, m: int, fmt: BlockFormat) -> torch.Tensor:
    return q8._codes(packet, m, fmt).view(torch.uint8)


def _packet(m: int, fmt: BlockFormat, offset: int = 0) -> torch.Tensor:
    """A packet's buffer, ``offset`` bytes into a larger one (filled with garbage)."""
    size = q8.packet_bytes(m, fmt)
    return torch.full((size + offset,), 0xA5, dtype=torch.uint8)[offset:]


def _reference_quantize(x: torch.Tensor, fmt: BlockFormat) -> tuple[np.ndarray, np.ndarray]:
    codes, scales = blocks.quantize(x.numpy(), fmt)
    return (codes if fmt.wire == "int8" else codes.view(np.uint8)), scales


def _kernels(fmt: BlockFormat) -> native.QuantKernels:
    if shutil.which("cc") is None and shutil.which("gcc") is None and shutil.which("clang") is None:
        pytest.skip("no C compiler: the torch ops run instead")
    kernels = native.quant_kernels(q8.wire_dtype(fmt), fmt.scale, fmt.block, torch.float32, torch.device("cpu"))
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
            assert np.array_equal(codes_out, ref_codes if fmt.wire == "int8" else ref_codes.view(np.uint8))
            kept = blocks.dequantize(ref_codes, ref_scales, fmt, m) if keep else partial
            assert _same(mine, kept)


@pytest.mark.parametrize("wire", ["int8", "fp8"])
def test_rounding_ties_and_every_code(wire: str) -> None:
    """A block whose absmax is QMAX has scale 1 (exact in every scale dtype), so its codes are its
    values rounded: every code, every tie between neighbours and the values beside each tie."""
    top = blocks.QMAX[wire]
    if wire == "int8":
        grid = np.arange(-127, 128, dtype=np.float32)
    else:
        grid = blocks.FP8_VALUES[np.isfinite(blocks.FP8_VALUES)]
    grid = np.unique(grid)
    ties = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(ties, np.float32(-np.inf)), np.nextafter(ties, np.float32(np.inf))])
    values = np.concatenate([grid, ties, near, -ties, -near, np.float32([-0.0, 1e-30, -1e-30])])
    for scale in blocks.SCALE_DTYPES:
        fmt = BlockFormat(wire, 63, scale)
        chunks = [np.concatenate([[top], values[i : i + 62]]) for i in range(0, len(values), 62)]
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
    """All 256 bytes (the e4m3fn NaNs included), by a scale of 1 and of 0.75, through the torch ops
    and the compiled kernels."""
    for wire in blocks.WIRES:
        fmt = BlockFormat(wire, 256, scale)
        codes = np.arange(256, dtype=np.uint8)
        for value in (1.0, 0.75):
            raw = torch.tensor([value], dtype=q8.scale_dtype(fmt)).view(torch.uint8)
            packet = torch.cat([raw, torch.from_numpy(codes)])
            given = codes.view(np.int8) if wire == "int8" else codes
            expected = blocks.dequantize(given, np.float32([value]), fmt, 256)
            out = torch.empty(256)
            q8.dequantize_into(out, packet, fmt)
            assert _same(out, expected)
            if shutil.which("cc"):
                _kernels(fmt).dequantize(packet, out)
                assert _same(out, expected)


def test_block_sums_spread_nonfinite_within_their_block_only() -> None:
    fmt = BlockFormat("int8", 8, "bf16")
    x = torch.randn(64)
    x[19] = float("inf")
    packet = _packet(64, fmt)
    q8.quantize_into(x, packet, fmt)
    out = torch.empty(64)
    q8.dequantize_into(out, packet, fmt)
    assert torch.isnan(out[16:24]).all() and torch.isfinite(out[:16]).all() and torch.isfinite(out[24:]).all()


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
    for wire in blocks.WIRES:
        fmt = BlockFormat(wire, 1, scale)
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


# ---------------------------------------------------------------------------------------------
# On CUDA: the same bits as on the CPU, and no host synchronisation


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize(
    "fmt", [BlockFormat("int8", 64, "bf16"), BlockFormat("fp8", 32, "fp32"), BlockFormat("int8", 7, "fp16")], ids=_ids
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
