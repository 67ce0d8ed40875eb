"""cerar bench's rows and its coding limit (cerar.experiments.bench.limit, .schema, .report): the
4-bit ring and the direct rows among the defaults, every row but auto called without an error budget, and the
"x limit" column for the lossy rings' codecs, whose time the ring program records on the CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cerar.experiments.bench.config import DEFAULT_METHODS, BenchConfig
from cerar.experiments.bench.limit import coding_bytes_per_value, ring_codec
from cerar.experiments.bench.methods import get_method
from cerar.experiments.bench.report import format_table
from cerar.experiments.bench.schema import add_ratios, make_record, validate_document

MiB = 1 << 20


def test_the_bench_times_the_int4_ring_and_the_direct_rows_beside_int8() -> None:
    order = [DEFAULT_METHODS.index(m) for m in ("ring-int8", "direct-int8", "ring-int4", "direct-int4")]
    assert order == sorted(order) and order[-1] - order[0] == 3
    assert {"ring-int4", "direct-int4"} <= set(BenchConfig().methods)
    assert get_method("ring-int4").wire_bytes_per_value == 0.5625  # 4-bit codes, a bfloat16 scale per 32


def _started(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """What the bench's calls hand the route table's ``start``, instead of starting them."""
    from cerar.comm.collective import routes

    calls: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(routes, "start", lambda route, tensor, **options: calls.append((route.name, options)))
    monkeypatch.delenv("CERAR_RANKS_PER_NODE", raising=False)
    return calls


def test_the_bench_measures_every_row_without_a_budget_but_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    from cerar.coding.linear_code import MAX_ERROR
    from cerar.comm.collective.routes import get_route

    # ring-int4 predicts about 0.19 at N = 4: the library's default budget refuses it...
    with pytest.raises(ValueError, match=r"Argument 'max_error' is 0\.1, but method 'ring-int4' predicts"):
        get_route("ring-int4").check_error(4, MAX_ERROR)
    get_route("ring-int4").check_error(4, None)  # ... max_error=None runs it
    calls = _started(monkeypatch)
    x = torch.zeros(8)
    for name in ("ring-int4", "ring-int8", "builtin", "ring-fp16", "cerar-fp16", "hier-ring-int4"):
        get_method(name).call(x, None, None)
    assert [options["max_error"] for _, options in calls] == [None] * 6
    # auto's max_error is its budget: the case's, else the library's default, as before
    calls.clear()
    auto = get_method("auto")
    assert auto.options == ("max_error",)
    auto.call(x, None, None, max_error=0.05)
    auto.call(x, None, None)
    assert calls[0] == ("auto", {"stats": None, "max_error": 0.05})
    assert calls[1] == ("auto", {"stats": None})


def test_the_lossy_rings_codecs_have_a_limit() -> None:
    # 2 s_x + w (3 - 2/N): the input read and the result written once, N packets written, 2(N-1) read
    assert coding_bytes_per_value(get_method("ring-int4"), 4, None) == 8 + 0.5625 * 2.5
    assert coding_bytes_per_value(get_method("ring-int8"), 4, None) == 8 + (1 + 2 / 64) * 2.5
    assert coding_bytes_per_value(get_method("ring-fp8"), 4, None) == 8 + (1 + 2 / 64) * 2.5
    assert coding_bytes_per_value(get_method("ring-fp16"), 4, None) == 8 + 2 * 2.5
    assert coding_bytes_per_value(get_method("ring-bf16"), 8, None) == 8 + 2 * (3 - 2 / 8)
    # the direct shape: 4 (4 - 2/N) + w (3 - 1/N) (its own count, in the limit's module doc)
    assert coding_bytes_per_value(get_method("direct-int4"), 4, None) == 4 * 3.5 + 0.5625 * 2.75
    # a hierarchical ring: its ring of M = 2 nodes (on each rank's shard: the record's values)
    assert coding_bytes_per_value(get_method("hier-ring-int4"), 4, None, ranks_per_node=2) == 8 + 0.5625 * 2
    for exact in ("builtin", "ring", "hier-ring", "torch-fp16", "auto"):  # no codec the limit counts
        assert not ring_codec(get_method(exact))
        assert coding_bytes_per_value(get_method(exact), 4, None) is None
    assert coding_bytes_per_value(get_method("cerar"), 4, 8) == 21.0  # CERAR's as before


def _raw(method: str, size: int, **extra: Any) -> dict[str, Any]:
    return {
        "case": {"method": method, "size_bytes": size, "components": None, "construction": None},
        "times_s": [0.02, 0.021, 0.019], "bytes_sent": [1.0], "wire_bytes": [], "rel_errors": [0.15] * 4,
        "copy_bandwidth": 1e10, **extra,
    }  # fmt: skip


def test_a_ring_record_and_its_table_row_show_the_codec_against_the_limit() -> None:
    size = 16 * MiB
    codec = {"encode_s": [0.004] * 3, "decode_s": [0.002] * 3, "coding_cpu_s": [0.005, 0.004, 0.006]}
    ring = make_record(_raw("ring-int4", size, **codec), "fast", 4, None)
    limit = (8 + 0.5625 * 2.5) * (size / 4) / 1e10
    assert ring["coding_limit_s"] == pytest.approx(limit)
    assert ring["coding_limit_ratio"] == pytest.approx(0.006 / limit)
    assert ring["coding_cpu_limit_ratio"] == pytest.approx(0.005 / limit)
    builtin = make_record(_raw("builtin", size), "fast", 4, None)
    exact_ring = make_record(_raw("ring", size, **codec), "fast", 4, None)
    assert exact_ring["encode_s"] == 0.004 and exact_ring["coding_limit_ratio"] is None  # timed, no limit
    records = [builtin, ring, exact_ring]
    add_ratios(records)
    doc = {"machine": {}, "versions": {}, "world_size": 4, "link_rate_bytes_per_s": None, "results": records,
           "regimes": {"fast": {}}}  # fmt: skip
    validate_document(doc)
    table = format_table(doc)
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.startswith("         ")}
    assert rows["ring-int4"][-4:] == ["4", "2", f"{0.006 / limit:.1f}/{0.005 / limit:.1f}", "0.15"]  # enc, dec ms
    assert rows["ring"][-4:] == ["4", "2", "-", "0.15"]  # the exact ring: timed, no limit
    legend = " ".join(table.splitlines())
    assert "w(3 - 2/N)" in legend and "2(N-1) read" in legend and "4(1 + L/c) + p + 8" in legend


class _Done:
    def wait(self) -> bool:
        return True


class _Loopback:
    """A process group whose sends and receives complete at once (nothing moves)."""

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Done:
        return _Done()

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Done:
        return _Done()


@pytest.mark.parametrize("wire", ["int4", "int8", "fp16", "fp32"])
def test_the_ring_program_times_its_codec_on_the_cpu(wire: str) -> None:
    from cerar.comm.algorithms.ring.program import run_ring
    from cerar.comm.algorithms.ring.wires import WIRES
    from cerar.comm.runtime.links import Ring
    from cerar.comm.runtime.stats import CommStats

    ring = Ring(group=None, rank=0, size=3, send_to=1, recv_from=2)
    ring.__dict__["endpoints"] = (_Loopback(), 1, 2)  # what the cached property would hold
    stats = CommStats()
    run_ring(torch.randn(3 * 4096), ring, stats, WIRES[wire])
    assert stats.rounds == 4 and stats.encode_s > 0 and stats.decode_s > 0
    assert 0 <= stats.coding_cpu_s <= (stats.encode_s + stats.decode_s) * 1.5 + 1e-3  # the thread's CPU in them
