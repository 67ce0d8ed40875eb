"""The route table: every row's figures against the formulas they stand for, the lookups, and the
argument checks that run before anything is queued (single process, no group needed)."""

from __future__ import annotations

import math

import pytest
import torch

import cerar.comm.auto.collective  # noqa: F401 (registers the auto row)
from cerar.coding import codes
from cerar.coding.blocks import BlockFormat, ring_error_bound
from cerar.comm.auto.candidates import CANDIDATE_NAMES, ROWS
from cerar.comm.collective.routes import ROUTES, get_route, route_for, start

N = 4


def test_every_way_in_names_rows_of_the_table() -> None:
    assert set(ROUTES) >= {
        "exact", "torch-fp16", "torch-bf16", "ring", "ring-fp16", "ring-bf16", "ring-int8", "ring-fp8", "cerar",
        "cerar-fp16", "cerar-bf16", "hier-ring", "hier-cerar", "auto",
    }  # fmt: skip
    for context in ("ddp", "collective"):
        assert set(ROWS[context]) == set(CANDIDATE_NAMES)
        assert all(row in ROUTES for row in ROWS[context].values())


def test_bytes_per_value_are_the_formulas() -> None:
    ring = 2 * (N - 1) / N
    assert get_route("exact").bytes_per_value(N) == pytest.approx(4 * ring)
    assert get_route("ring-fp16").bytes_per_value(N) == pytest.approx(2 * ring)
    assert get_route("torch-bf16").bytes_per_value(N) == pytest.approx(2 * ring)
    assert get_route("ring-int8").bytes_per_value(N) == pytest.approx(BlockFormat("int8").bytes_per_value * ring)
    assert get_route("cerar").bytes_per_value(N, 8) == pytest.approx(4 * (8 + N - 2) / 8)
    assert get_route("cerar-fp16").bytes_per_value(N, 8) == pytest.approx(2 * (8 + N - 2) / 8)
    assert get_route("ring").bytes_per_value(N, data_bytes=8) == pytest.approx(8 * ring)  # float64 data


def test_error_bounds_are_the_predictions() -> None:
    assert get_route("ring-fp16").error_bound(N) == pytest.approx(2.0**-11 * math.sqrt((N + 1) / 2))
    assert get_route("ring-int8").error_bound(N) == pytest.approx(ring_error_bound(N, BlockFormat("int8")))
    code = codes.perturbed(N, 2 * N)
    assert get_route("cerar").error_bound(N, code) == pytest.approx(code.predicted_worst_error("fp32"))
    assert get_route("ring").exact_sum and get_route("ring-int8").identical and not get_route("ring-int8").exact_sum
    assert not get_route("cerar").identical


def test_a_family_and_a_dtype_find_their_row() -> None:
    assert route_for("cerar", torch.float16).name == "cerar-fp16"
    assert route_for("ring", torch.int8).name == "ring-int8"
    assert route_for("ring", torch.float8_e4m3fn).name == "ring-fp8"
    assert route_for("ring", torch.float32).name == route_for("ring").name == "ring"
    assert route_for("hier-cerar", torch.float16).name == "hier-cerar"  # the family row takes the dtype
    with pytest.raises(ValueError, match=r"^Argument 'method' must be one of \[.*\], not 'nccl'\.$"):
        get_route("nccl")


@pytest.mark.parametrize(
    ("route", "options", "message"),
    [
        ("ring", {"code": codes.exact(N)}, "Argument 'code' does not apply to method 'ring'"),
        ("ring-int8", {"wire_dtype": torch.float16}, "Argument 'wire_dtype' does not apply to method 'ring-int8'"),
        ("cerar", {"ranks_per_node": 2}, "Argument 'ranks_per_node' applies to the hierarchical methods only"),
        ("cerar", {"nonfinite": "skip"}, "Argument 'nonfinite'"),
        ("cerar", {"widget": 1}, "unknown arguments ['widget']"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_queued(route: str, options: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[").replace("]", r"\]")):
        start(route, torch.ones(4), **options)


def test_a_renamed_argument_warns_naming_the_new_one_and_refuses_both() -> None:
    from cerar._checks import renamed

    assert renamed("packet_dtype", None, "wire_dtype", torch.float16) is torch.float16
    with pytest.warns(DeprecationWarning, match=r"'packet_dtype' is deprecated: pass wire_dtype=torch.float16"):
        assert renamed("packet_dtype", torch.float16, "wire_dtype", None) is torch.float16
    with pytest.raises(TypeError, match="'packet_dtype' and 'wire_dtype' name the same setting"):
        renamed("packet_dtype", torch.float16, "wire_dtype", torch.bfloat16)


def test_the_old_group_form_names_its_row() -> None:
    from cerar.comm.group.process_group import GroupSettings

    with pytest.warns(DeprecationWarning, match="method='ring-int8'"):
        assert GroupSettings("ring", wire_dtype=torch.int8).method == "ring-int8"
    with pytest.warns(DeprecationWarning, match="method='hier-ring-int8'"):
        settings = GroupSettings("ring", wire_dtype=torch.int8, ranks_per_node=2)
    assert (settings.method, settings.wire_dtype) == ("hier-ring-int8", None)
    with pytest.warns(DeprecationWarning, match="method='hier-cerar'"):
        assert GroupSettings("cerar", wire_dtype=torch.float16, ranks_per_node=2).wire_dtype == torch.float16
    assert GroupSettings("ring-int8").method == "ring-int8"  # a row: no warning
    with pytest.raises(ValueError, match="Argument 'code' does not apply to method 'ring-int8'"):
        GroupSettings("ring-int8", code=codes.exact(4))
    with pytest.raises(ValueError, match="Argument 'method' must be one of"):
        GroupSettings("ring-int1")
