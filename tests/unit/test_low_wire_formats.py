"""The block wires below 4 bits, int3 (codes in [-3, 3], 3 bits, eight in three bytes) and int2
(ternary, 2 bits, four a byte): the bit-stream packing (cerar.coding.blocks.pack_codes, int4's
bytes unchanged), the block sizes they take, the torch ops (cerar.comm.algorithms.ring.quantize)
against the numpy reference bit for bit, no compiled kernels (the torch ops run), the error bound
against the simulators, and their rows in the route table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cerar.coding import blocks
from cerar.coding.blocks import (
    CODE_BITS,
    DEFAULT_BLOCK,
    QMAX,
    BlockFormat,
    code_bytes,
    dequantize,
    direct_round_trip,
    pack_codes,
    pack_int4,
    quantize,
    ring_error_bound,
    round_trip,
    unpack_codes,
    unpack_int4,
)
from cerar.comm.algorithms import native
from cerar.comm.algorithms.ring import quantize as q8
from cerar.comm.algorithms.ring.block_ops import TorchQuantOps, quant_ops, quant_pieces
from cerar.protocol.simulate_ring import ring_bytes_per_value, simulate_ring

LOW = ("int3", "int2")
#: Block sizes per wire: the smallest, a middling one that is not a power of two, and 64.
TEST_BLOCKS = {"int3": (8, 24, 64), "int2": (4, 12, 64)}
FORMATS = [
    BlockFormat(wire, block, scale) for wire in LOW for scale in blocks.SCALE_DTYPES for block in TEST_BLOCKS[wire]
]
KINDS = ("normal", "heavy", "zero", "tiny", "huge", "nonfinite", "mixed")
LENGTHS = (1, 3, 5, 7, 8, 13, 64, 65, 1001)  # lengths whose last byte holds pad bits


def _ids(fmt: BlockFormat) -> str:
    return f"{fmt.wire}-{fmt.scale}-B{fmt.block}"


def _values(kind: str, m: int, seed: int) -> torch.Tensor:
    """``m`` float32 values of one of the kinds the format must treat exactly (as test_quantize's)."""
    g = np.random.default_rng(seed)
    if kind == "normal":
        x = g.standard_normal(m)
    elif kind == "heavy":
        x = g.standard_t(1.5, m) * 2.0 ** g.integers(-20, 20, m)
    elif kind == "zero":
        x = np.zeros(m)
    elif kind == "tiny":
        x = g.standard_normal(m) * 2.0 ** g.integers(-149, -110, m)
    elif kind == "huge":
        x = g.standard_normal(m) * 2.0 ** g.integers(100, 126, m)
    elif kind == "nonfinite":
        x = g.standard_normal(m)
        x[g.integers(0, m, max(1, m // 50))] = np.nan
        x[g.integers(0, m, max(1, m // 50))] = np.inf
        x[g.integers(0, m, max(1, m // 50))] = -np.inf
    else:
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


def _packet(m: int, fmt: BlockFormat, offset: int = 0) -> torch.Tensor:
    """A packet's buffer, ``offset`` bytes into a larger one filled with garbage."""
    return torch.full((q8.packet_bytes(m, fmt) + offset,), 0xA5, dtype=torch.uint8)[offset:]


def _unpack(packet: torch.Tensor, m: int, fmt: BlockFormat) -> tuple[np.ndarray, np.ndarray]:
    """A packet's ``(codes unpacked, scales as float32)``, its code bytes checked to be the
    reference's packing of those codes, pad bits included."""
    scales = q8._scales(packet, m, fmt).numpy()
    raw = q8._codes(packet, m, fmt).view(torch.uint8).numpy()
    assert raw.shape == (-(-m * fmt.code_bits // 8),)
    codes = unpack_codes(raw, m, fmt.code_bits)
    assert np.array_equal(pack_codes(codes, fmt.code_bits), raw)  # the last byte's pad bits are 0
    return codes, scales


# ---------------------------------------------------------------------------------------------
# The packing


def test_the_wires_and_their_figures() -> None:
    assert blocks.WIRES[-2:] == LOW
    assert (QMAX["int3"], QMAX["int2"], CODE_BITS["int3"], CODE_BITS["int2"]) == (3.0, 1.0, 3, 2)
    assert BlockFormat("int3") == BlockFormat("int3", DEFAULT_BLOCK["int3"], "bf16")
    assert BlockFormat("int2") == BlockFormat("int2", DEFAULT_BLOCK["int2"], "bf16")
    assert BlockFormat("int3", 64, "bf16").bytes_per_value == 3 / 8 + 2 / 64
    assert BlockFormat("int2", 128, "bf16").bytes_per_value == 0.25 + 2 / 128
    assert BlockFormat("int3", 8).code_bytes(13) == 5 and BlockFormat("int2", 4).code_bytes(13) == 4
    assert ring_bytes_per_value(4, "int2", BlockFormat("int2", 32)) == 1.5 * (0.25 + 2 / 32)


@pytest.mark.parametrize(("wire", "bad", "unit"), [("int3", 12, 8), ("int3", 4, 8), ("int3", 1, 8), ("int2", 6, 4)])
def test_blocks_must_start_on_a_whole_byte(wire: str, bad: int, unit: int) -> None:
    with pytest.raises(ValueError, match=rf"^Argument 'block' must be a multiple of {unit} .*{wire!r}.*, not {bad}\.$"):
        BlockFormat(wire, bad)
    with pytest.raises(ValueError, match=r"'block'.*even.*7"):  # int4's refusal as it was
        BlockFormat("int4", 7)
    BlockFormat(wire, 2 * unit)


def test_int3_and_int2_bytes_by_hand() -> None:
    # int3: fields 001 010 011 111 110 101 000 001 from bit 0 up: the 24-bit word 0x22EED1, low byte first
    assert pack_codes(np.int8([1, 2, 3, -1, -2, -3, 0, 1]), 3).tolist() == [0xD1, 0xEE, 0x22]
    # five codes: 15 bits in two bytes, the 16th bit a 0 pad
    assert pack_codes(np.int8([-3, 3, -1, 0, 2]), 3).tolist() == [0xDD, 0x21]
    # int2: value 4i in the lowest two bits of byte i; an odd count pads with 0 bits
    assert pack_codes(np.int8([1, -1, 0, 1, -1]), 2).tolist() == [0x4D, 0x03]
    assert unpack_codes(np.uint8([0x4D, 0x03]), 5, 2).tolist() == [1, -1, 0, 1, -1]
    assert unpack_codes(np.uint8([0xDD, 0x21]), 5, 3).tolist() == [-3, 3, -1, 0, 2]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_packing_round_trips(bits: int) -> None:
    g = np.random.default_rng(bits)
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    for m in (0, 1, 2, 3, 5, 7, 8, 9, 24, 31, 1001):
        codes = g.integers(low, high + 1, (3, m)).astype(np.int8)
        packed = pack_codes(codes, bits)
        assert packed.dtype == np.uint8 and packed.shape == (3, -(-m * bits // 8))
        assert np.array_equal(unpack_codes(packed, m, bits), codes)
    # every byte pattern of whole groups, both ways (3 bits: random bytes, three a group)
    every = g.integers(0, 256, 3 * 4096).astype(np.uint8) if bits == 3 else np.arange(256, dtype=np.uint8)
    m = every.size * 8 // bits
    assert np.array_equal(pack_codes(unpack_codes(every, m, bits), bits), every)
    with pytest.raises(ValueError, match="'packed'"):
        unpack_codes(every, m + 8, bits)


def test_int4_bytes_are_unchanged() -> None:
    codes = np.int8([1, -1, 7, -7, -8, 0, 3])
    assert pack_int4(codes).tolist() == pack_codes(codes, 4).tolist() == [0xF1, 0x97, 0x08, 0x03]
    every = np.arange(256, dtype=np.uint8)
    assert np.array_equal(unpack_int4(every, 512), unpack_codes(every, 512, 4))
    # the torch packing too (the byte format the compiled kernels and older peers read)
    q = torch.tensor([1, -1, 7, -7, 3, 0, 6, -6, 6, -7, 2], dtype=torch.float32)
    assert q8._pack_codes(q, 4).tolist() == [0xF1, 0x97, 0x03, 0xA6, 0x96, 0x02]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_torch_packing_is_the_references(bits: int) -> None:
    g = np.random.default_rng(10 + bits)
    top = (1 << (bits - 1)) - 1
    for m in (1, 2, 3, 5, 8, 11, 24, 1001):
        codes = g.integers(-top, top + 1, m).astype(np.int8)
        packed = q8._pack_codes(torch.from_numpy(codes.astype(np.float32)), bits)
        assert packed.dtype == torch.uint8 and np.array_equal(packed.numpy(), pack_codes(codes, bits))
        assert q8._unpack_codes(packed, m, bits).tolist() == codes.astype(np.float32).tolist()


def test_code_bytes_and_packet_bytes() -> None:
    fmt3, fmt2 = BlockFormat("int3", 8, "fp32"), BlockFormat("int2", 4, "fp16")
    codes = np.int8([1, -1, 0, 1, -1])
    assert np.array_equal(code_bytes(codes, fmt3), pack_codes(codes, 3))
    assert np.array_equal(code_bytes(codes, fmt2), pack_codes(codes, 2))
    assert q8.packet_bytes(13, fmt3) == 2 * 4 + 5 and q8.packet_bytes(13, fmt2) == 4 * 2 + 4
    fmt = BlockFormat("int3", 64, "bf16")
    assert q8.packet_bytes(640, fmt) == 640 * fmt.bytes_per_value == 10 * 2 + 240
    assert q8.wire_dtype(fmt) is torch.uint8 and q8.qmax(fmt) == 3.0


# ---------------------------------------------------------------------------------------------
# Rounding by hand


def test_int3_and_int2_round_half_to_even_and_clamp() -> None:
    # absmax 3: scale 1, the codes are the values rounded half to even
    codes, scales = quantize(np.float32([3, 2.5, 1.5, -0.5, 0.5, -2.5, -3, 1.2]), BlockFormat("int3", 8, "fp32"))
    assert scales.tolist() == [1.0] and codes.tolist() == [3, 2, 2, 0, 0, -2, -3, 1]
    # absmax 1: ternary; +-0.5 ties go to 0
    codes, scales = quantize(np.float32([1, 0.5, -0.5, -1, 0.51, -0.49, 0, -0.75]), BlockFormat("int2", 4, "fp32"))
    assert scales.tolist() == [1.0, 0.75] and codes.tolist() == [1, 0, 0, -1, 1, -1, 0, -1]
    # a bfloat16 scale that rounds down (1 + 2^-9 -> 1): x / s > 1 is clamped to 1
    top = 1 + 2.0**-9
    codes, scales = quantize(np.float32([top, -top, 0.4, 0]), BlockFormat("int2", 4, "bf16"))
    assert scales.tolist() == [1.0] and codes.tolist() == [1, -1, 0, 0]
    assert dequantize(codes, scales, BlockFormat("int2", 4, "bf16"), 4).tolist() == [1, -1, 0, 0]


@pytest.mark.parametrize("wire", LOW)
def test_rounding_ties_and_every_code(wire: str) -> None:
    """Blocks whose absmax is QMAX (scale 1 in every dtype): every code, every tie between
    neighbours and the floats beside each tie, through the torch ops and the reference."""
    top = QMAX[wire]
    grid = np.arange(-top, top + 1, dtype=np.float32)
    ties = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(ties, np.float32(-np.inf)), np.nextafter(ties, np.float32(np.inf))])
    values = np.concatenate([grid, ties, near, -ties, -near, np.float32([-0.0, 1e-30, -1e-30])])
    block = 64
    for scale in blocks.SCALE_DTYPES:
        fmt = BlockFormat(wire, block, scale)
        chunks = [np.concatenate([[top], values[i : i + block - 1]]) for i in range(0, len(values), block - 1)]
        x = torch.from_numpy(np.concatenate(chunks).astype(np.float32))
        packet = _packet(x.numel(), fmt)
        q8.quantize_into(x, packet, fmt)
        codes, scales = _unpack(packet, x.numel(), fmt)
        assert np.all(scales == 1.0)
        ref_codes, _ = quantize(x.numpy(), fmt)
        assert np.array_equal(codes, ref_codes)
        assert set(np.unique(codes).tolist()) == set(range(-int(top), int(top) + 1))


# ---------------------------------------------------------------------------------------------
# The torch ops against the numpy reference, bit for bit


@pytest.mark.parametrize("fmt", FORMATS, ids=_ids)
@pytest.mark.parametrize("kind", KINDS)
def test_torch_ops_match_the_reference(fmt: BlockFormat, kind: str) -> None:
    for seed, m in enumerate(LENGTHS):
        x, own = _values(kind, m, seed), _values("normal", m, seed + 100)
        arrived = _packet(m, fmt, offset=seed % 3)
        q8.quantize_into(x, arrived, fmt)
        codes, scales = _unpack(arrived, m, fmt)
        ref_codes, ref_scales = quantize(x.numpy(), fmt)
        assert _same(scales, ref_scales), (m, scales, ref_scales)
        assert np.array_equal(codes, ref_codes), (m, np.flatnonzero(codes != ref_codes)[:10])
        expected = dequantize(ref_codes, ref_scales, fmt, m)
        out = torch.full((m,), 7.0)
        q8.dequantize_into(out, arrived, fmt)
        assert _same(out, expected)
        acc = own.clone()
        q8.dequantize_add_(acc, arrived, fmt)
        partial = own.numpy() + expected
        assert _same(acc, partial)
        for keep in (False, True):
            mine, sent = own.clone(), _packet(m, fmt, offset=1)
            q8.dequant_add_requant(mine, arrived, sent, fmt, keep=keep)
            sent_codes, sent_scales = _unpack(sent, m, fmt)
            ref_codes, ref_scales = quantize(partial, fmt)
            assert _same(sent_scales, ref_scales) and np.array_equal(sent_codes, ref_codes)
            assert _same(mine, dequantize(ref_codes, ref_scales, fmt, m) if keep else partial)


@pytest.mark.parametrize("scale", blocks.SCALE_DTYPES)
def test_every_byte_dequantizes_as_the_reference(scale: str) -> None:
    for wire in LOW:
        bits = CODE_BITS[wire]
        raw = np.arange(256, dtype=np.uint8) if bits == 2 else np.random.default_rng(3).integers(0, 256, 768)
        raw = raw.astype(np.uint8)
        m = raw.size * 8 // bits
        fmt = BlockFormat(wire, m, scale)
        for value in (1.0, 0.75):
            head = torch.tensor([value], dtype=q8.scale_dtype(fmt)).view(torch.uint8)
            packet = torch.cat([head, torch.from_numpy(raw)])
            expected = dequantize(unpack_codes(raw, m, bits), np.float32([value]), fmt, m)
            out = torch.empty(m)
            q8.dequantize_into(out, packet, fmt)
            assert _same(out, expected)


@pytest.mark.parametrize("scale", blocks.SCALE_DTYPES)
def test_scales_round_alike_over_every_binade(scale: str) -> None:
    """Random mantissas at every float32 exponent, in blocks of the smallest size each wire takes."""
    g = np.random.default_rng(5)
    bits = (g.integers(0, 255, 40_000, dtype=np.uint32) << 23) | g.integers(0, 1 << 23, 40_000, dtype=np.uint32)
    x = torch.from_numpy(bits.view(np.float32) * np.where(g.random(40_000) < 0.5, -1, 1).astype(np.float32))
    for wire in LOW:
        fmt = BlockFormat(wire, 8 if wire == "int3" else 4, scale)
        packet = _packet(x.numel(), fmt)
        q8.quantize_into(x, packet, fmt)
        codes, scales = _unpack(packet, x.numel(), fmt)
        ref_codes, ref_scales = quantize(x.numpy(), fmt)
        assert _same(scales, ref_scales) and np.array_equal(codes, ref_codes)


@pytest.mark.parametrize("wire", LOW)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_spreads_within_its_block_only(wire: str, bad: float) -> None:
    fmt = BlockFormat(wire, 8, "bf16")
    x = torch.randn(61)  # the last block short, its last byte with pad bits
    x[19] = bad
    packet = _packet(61, fmt)
    q8.quantize_into(x, packet, fmt)
    out = torch.empty(61)
    q8.dequantize_into(out, packet, fmt)
    assert torch.isnan(out[16:24]).all() and torch.isfinite(out[:16]).all() and torch.isfinite(out[24:]).all()
    codes, _ = _unpack(packet, 61, fmt)
    assert (codes[16:24] == 0).all()


@pytest.mark.parametrize("wire", LOW)
def test_pieces_of_a_chunk_hold_whole_blocks_and_match_the_whole(wire: str) -> None:
    """A chunk cut into several packets (pieces of about 256 KiB): each starts on a block, and the
    pieces quantized one by one are the chunk's reference codes and scales, piece by piece."""
    fmt = BlockFormat(wire, DEFAULT_BLOCK[wire], "bf16")
    chunk = 2_500_003
    pieces = quant_pieces(chunk, fmt)
    assert len(pieces) > 1 and pieces[0][0] == 0 and pieces[-1][1] == chunk
    x = _values("normal", chunk, 9)
    ref_codes, ref_scales = quantize(x.numpy(), fmt)
    buffer = torch.full((pieces[-1][2] + pieces[-1][3],), 0xA5, dtype=torch.uint8)
    ops = quant_ops(fmt, torch.float32, torch.device("cpu"))
    for a, b, offset, size in pieces:
        assert a % fmt.block == 0 and offset % 16 == 0 and size == q8.packet_bytes(b - a, fmt)
        ops.quantize(x[a:b], buffer[offset : offset + size])
    for a, b, offset, size in pieces:
        codes, scales = _unpack(buffer[offset : offset + size], b - a, fmt)
        assert np.array_equal(codes, ref_codes[a:b])
        assert _same(scales, ref_scales[a // fmt.block : fmt.blocks(b)])


def test_the_compiled_kernels_leave_them_to_the_torch_ops() -> None:
    cpu = torch.device("cpu")
    for wire in LOW:
        for block in (8, 64):
            assert native.quant_kernels(wire, "bf16", block, torch.float32, cpu) is None
            assert isinstance(quant_ops(BlockFormat(wire, block), torch.float32, cpu), TorchQuantOps)
    assert "int3" not in native.QUANT_WIRES and "int2" not in native.QUANT_WIRES


# ---------------------------------------------------------------------------------------------
# The error bound against the simulators, and the route table's rows


@pytest.mark.parametrize("wire", LOW)
@pytest.mark.parametrize("world_size", [4, 8])
def test_ring_and_direct_within_the_bound(wire: str, world_size: int) -> None:
    """Gaussian inputs: the simulated worst-rank error is 0.7-0.9x the bound, ring and direct."""
    fmt = BlockFormat(wire)
    x = np.random.default_rng(world_size).standard_normal((world_size, 40_000)).astype(np.float32)
    exact = x.astype(np.float64).sum(0)
    norm = np.linalg.norm(exact)
    ring = simulate_ring(x, wire, block_format=fmt)
    assert all(np.array_equal(ring.outputs[0], row) for row in ring.outputs[1:])
    direct = direct_round_trip(x, fmt).astype(np.float64)
    for error, shape in ((ring.worst_relative_error, "ring"), (np.linalg.norm(direct - exact) / norm, "direct")):
        bound = ring_error_bound(world_size, fmt, shape=shape)
        assert 0.6 * bound < error <= bound, (shape, error, bound)
    assert ring_error_bound(world_size, fmt, "direct") < ring_error_bound(world_size, fmt)


def test_coarser_codes_err_more() -> None:
    errors = [ring_error_bound(4, BlockFormat(wire, 32)) for wire in ("int8", "int4", "int3", "int2")]
    assert errors == sorted(errors)
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    rel = [np.linalg.norm(round_trip(x, BlockFormat(w, 32)) - x) / np.linalg.norm(x) for w in ("int4", "int3", "int2")]
    assert rel == sorted(rel) and rel[-1] < 1  # one ternary rounding still keeps some of the vector


def test_the_route_table_has_their_rows_and_auto_leaves_them_out() -> None:
    from cerar.comm.auto.candidates import CANDIDATE_NAMES, ROWS
    from cerar.comm.collective.routes import BLOCK_WIRES, ROUTES, WIRE_BYTES

    for wire in LOW:
        assert wire in BLOCK_WIRES and WIRE_BYTES[wire] == BlockFormat(wire).bytes_per_value
        for family in ("ring", "direct", "hier-ring"):
            assert ROUTES[f"{family}-{wire}"].wire == wire
        assert ROUTES[f"ring-{wire}"].error_bound(4) == ring_error_bound(4, BlockFormat(wire))
        assert ROUTES[f"direct-{wire}"].error_bound(4) == ring_error_bound(4, BlockFormat(wire), "direct")
        assert ROUTES[f"ring-{wire}"].takes_feedback and ROUTES[f"direct-{wire}"].takes_feedback
        # the library's default budget (0.1) refuses them; max_error=None runs them
        with pytest.raises(ValueError, match=rf"'max_error' is 0\.1, but method 'direct-{wire}' predicts"):
            ROUTES[f"direct-{wire}"].check_error(4, 0.1)
        ROUTES[f"direct-{wire}"].check_error(4, None)
    assert not any(wire in name for name in CANDIDATE_NAMES for wire in LOW)
    assert not any(wire in row for rows in ROWS.values() for row in rows.values() for wire in LOW)


# ---------------------------------------------------------------------------------------------
# On CUDA: the same bits as on the CPU, and no host synchronisation


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize(
    "fmt",
    [BlockFormat("int3", 64, "bf16"), BlockFormat("int3", 8, "fp16"), BlockFormat("int2", 128, "bf16"),
     BlockFormat("int2", 4, "fp32")],
    ids=_ids,
)  # fmt: skip
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
    assert torch.equal(gpacket.cpu(), cpu_packet)
    assert torch.equal(gout.cpu(), cpu_out)
    assert _same(gown.cpu(), cpu_own)
