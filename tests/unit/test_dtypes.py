"""cerar.comm.runtime.dtypes: the one table of dtype names and torch dtypes, and its readers."""

from __future__ import annotations

import pytest
import torch

from cerar.coding.blocks import SCALE_DTYPES, WIRES, BlockFormat
from cerar.coding.precision import PRECISIONS, precision_name
from cerar.comm.algorithms import native
from cerar.comm.algorithms.ring import quantize
from cerar.comm.algorithms.ring.wires import WIRES as RING_WIRES
from cerar.comm.algorithms.ring.wires import BlockWire
from cerar.comm.collective.checks import PACKET_DTYPES, WIRE_DTYPES
from cerar.comm.runtime.dtypes import DTYPES, dtype_name, torch_dtype


def test_table_holds_every_name() -> None:
    assert DTYPES == {
        "fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
        "int8": torch.int8, "fp8": torch.float8_e4m3fn,
    }  # fmt: skip
    assert len(set(DTYPES.values())) == len(DTYPES)  # one name a dtype: the table reads both ways


@pytest.mark.parametrize("name", list(DTYPES))
def test_round_trip(name: str) -> None:
    assert dtype_name(DTYPES[name]) == name
    assert torch_dtype(name) is DTYPES[name]
    assert DTYPES[dtype_name(DTYPES[name])] is DTYPES[name]


@pytest.mark.parametrize("name", PRECISIONS)
def test_float_names_agree_with_precision_name(name: str) -> None:
    # Every precision of the torch-free coding layer is in the table, under the same name.
    assert name in DTYPES
    assert precision_name(DTYPES[name]) == dtype_name(DTYPES[name]) == name


@pytest.mark.parametrize("bad", [torch.int32, torch.uint8, torch.complex64, None, "fp32", 3])
def test_unknown_dtype_refused_naming_the_argument(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"^Argument 'dtype' must be one of torch\.float64, .*, not {bad!r}\.$"):
        dtype_name(bad)
    with pytest.raises(ValueError, match=r"^Argument 'wire_dtype' must be one of "):
        dtype_name(bad, "wire_dtype")


@pytest.mark.parametrize("bad", ["int4", "float16", "FP32", None, torch.float32])
def test_unknown_name_refused_naming_the_argument(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"^Argument 'packet' must be one of 'fp64', .*'fp8', not {bad!r}\.$"):
        torch_dtype(bad, "packet")


def test_readers_agree_with_the_table() -> None:
    for scale in SCALE_DTYPES:
        assert quantize.scale_dtype(BlockFormat("int8", scale=scale)) is DTYPES[scale]
    for wire in WIRES:
        expected = DTYPES.get(wire, torch.uint8)  # int4: packed, two codes a uint8
        assert quantize.wire_dtype(BlockFormat(wire)) is expected
        assert isinstance(RING_WIRES[wire], BlockWire)
    assert native.PACKET_KINDS == {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
    assert native.QUANT_WIRES == {torch.int8: 0, torch.float8_e4m3fn: 1, "int8": 0, "fp8": 1, "int4": 2}
    assert PACKET_DTYPES == (None, torch.float32, torch.float64, torch.float16, torch.bfloat16)
    assert WIRE_DTYPES == (*PACKET_DTYPES, torch.int8, torch.float8_e4m3fn)
