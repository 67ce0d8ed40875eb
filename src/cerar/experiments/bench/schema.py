"""The JSON document ``cerar bench --json`` writes: a stable interface, checked by
:func:`validate_document`.

Top level: ``schema_version``, ``created``, ``machine``, ``versions``, ``settings``,
``world_size``, ``link_rate_bytes_per_s`` (measured in ``slow``; null when only ``fast`` ran),
``regimes`` (per regime: rate, measured link rate, wall time, error), ``results`` (one record per
method, code, size and regime), ``fits`` (alpha-beta per series) and ``crossovers``.

Every record has at least the keys of :data:`RECORD_KEYS`; times in seconds, sizes in bytes,
bandwidths in bytes per second. ``bytes_sent_per_rank`` is measured at cerar's transport when the
method has one (``bytes_source: "transport"``) and the algorithm's figure otherwise
(``"theory"``, e.g. Gloo's built-in all-reduce); ``wire_bytes_per_rank`` is what the rank's
network link really sent in ``slow`` (TCP/IP headers and the barrier included; null in ``fast``).

Topology (emulated nodes, ``--nodes M --ranks-per-node G``; ``M = N``, ``G = 1`` without): the top
level and every record carry ``nodes`` and ``ranks_per_node``. ``inter_node_bytes_per_node`` is
what the busiest node sent to other nodes, measured at cerar's transport (hierarchical methods:
the sum over the node's ranks; flat ones: the node's last rank, whose ring hop leaves the node;
null for ``builtin``), ``theory_inter_node_bytes_per_node`` its theory (per value: flat ring
``2(N-1)/N``, flat CERAR ``1 + (N-2)/c``, ``hier-ring`` ``2(M-1)/M``, ``hier-cerar``
``1 + (M-2)/c``), and ``node_wire_bytes`` what the busiest node's one link really sent (``slow``
with nodes; null otherwise).

The cost model (:mod:`cerar.experiments.bench.model`): ``model`` holds its constants per regime
and every flat method's record its ``predicted_s`` beside the measured ``time_median_s`` (auto's:
the prediction for the method it chose, which its ``auto`` entry names with the reason and the
calibration calls it took; null for methods the model does not cover).
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import sys
from collections.abc import Mapping
from typing import Any

from cerar._version import __version__
from cerar.experiments.bench.limit import coding_bytes_per_value
from cerar.experiments.bench.methods import ALL_REDUCE_METHODS, get_method
from cerar.experiments.bench.stats import algbw as algbw_of
from cerar.experiments.bench.stats import busbw, summarize

SCHEMA_VERSION = 1
RECORD_KEYS: dict[str, tuple[type, ...]] = {
    "method": (str,),
    "components": (int, type(None)),
    "construction": (str, type(None)),
    "size_bytes": (int,),
    "regime": (str,),
    "world_size": (int,),
    "time_median_s": (float,),
    "time_min_s": (float,),
    "time_max_s": (float,),
    "times_s": (list,),
    "algbw_bytes_per_s": (float,),
    "busbw_bytes_per_s": (float,),
    "bytes_sent_per_rank": (float, int),
    "bytes_source": (str,),
    "theory_bytes_per_rank": (float, int),
    "wire_bytes_per_rank": (float, int, type(None)),
    "wire_limit_s": (float, type(None)),
    "encode_s": (float, type(None)),
    "decode_s": (float, type(None)),
    "handshake_s": (float, type(None)),
    "copy_bandwidth_bytes_per_s": (float, type(None)),
    "coding_limit_s": (float, type(None)),
    "coding_limit_ratio": (float, type(None)),
    "coding_cpu_s": (float, type(None)),
    "coding_cpu_limit_ratio": (float, type(None)),
    "worst_rel_error": (float,),
    "rel_errors": (list,),
    "ratio_to_builtin": (float, type(None)),
    "theory_ratio_to_builtin": (float, type(None)),
    "nodes": (int,),
    "ranks_per_node": (int,),
    "inter_node_bytes_per_node": (float, int, type(None)),
    "theory_inter_node_bytes_per_node": (float, int),
    "node_wire_bytes": (float, int, type(None)),
}
TOP_KEYS = ("machine", "versions", "world_size", "link_rate_bytes_per_s", "results")


def make_record(
    raw: Mapping[str, Any], regime: str, world_size: int, link_rate: float | None, ranks_per_node: int = 1
) -> dict[str, Any]:
    """One result record from a worker's raw figures (see :mod:`cerar.experiments.bench.worker`)."""
    case = raw["case"]
    method = get_method(case["method"])
    size = int(case["size_bytes"])
    components = case.get("components") if method.coded else None
    timing = summarize(raw["times_s"])
    theory = method.theory_bytes_per_rank(size, world_size, components, ranks_per_node)
    node_theory = method.theory_bytes_per_node(size, world_size, components, ranks_per_node)
    auto = raw.get("auto")
    if auto is not None:  # auto's bytes are those of the method it chose
        theory = node_theory = auto["bytes_per_value"] * size / 4.0
    inter_node = raw.get("inter_node_bytes")
    node_wire = raw.get("node_wire_bytes")
    if method.transport_stats and raw.get("bytes_sent") and max(raw["bytes_sent"]) > 0:
        sent: float = float(statistics.median(raw["bytes_sent"]))
        source = "transport"
    else:
        sent, source = theory, "theory"
    wire = float(statistics.median(raw["wire_bytes"])) if raw.get("wire_bytes") else None
    errors = [float(e) for e in raw["rel_errors"]]
    encode = float(statistics.median(raw["encode_s"])) if raw.get("encode_s") else None
    decode = float(statistics.median(raw["decode_s"])) if raw.get("decode_s") else None
    cpu = float(statistics.median(raw["coding_cpu_s"])) if raw.get("coding_cpu_s") else None
    bandwidth = raw.get("copy_bandwidth")
    per_value = coding_bytes_per_value(method, world_size, components, ranks_per_node)
    coded_values = size // 4 // (ranks_per_node if method.hierarchical else 1)
    limit = per_value * coded_values / bandwidth if per_value and bandwidth else None
    return {
        "method": method.name,
        "components": components,
        "construction": case.get("construction") if method.coded else None,
        "code_params": case.get("code_params"),
        "size_bytes": size,
        "regime": regime,
        "world_size": world_size,
        "iters": len(raw["times_s"]),
        "time_median_s": timing.median_s,
        "time_min_s": timing.min_s,
        "time_max_s": timing.max_s,
        "times_s": [float(t) for t in raw["times_s"]],
        "algbw_bytes_per_s": algbw_of(size, timing.median_s),
        "busbw_bytes_per_s": busbw(size, timing.median_s, world_size),
        "bytes_sent_per_rank": sent,
        "bytes_source": source,
        "theory_bytes_per_rank": theory,
        "wire_bytes_per_rank": wire,
        "wire_limit_s": sent / link_rate if link_rate else None,
        "encode_s": encode,
        "decode_s": decode,
        "handshake_s": float(statistics.median(raw["handshake_s"])) if raw.get("handshake_s") else None,
        "copy_bandwidth_bytes_per_s": float(bandwidth) if bandwidth else None,
        "coding_limit_s": limit,
        "coding_limit_ratio": (encode + decode) / limit if limit and None not in (encode, decode) else None,
        # The coding thread's CPU time in it: where ranks share the cores, encode + decode (wall
        # time) also holds the time the thread waited for one, which no kernel can remove.
        "coding_cpu_s": cpu if limit else None,
        "coding_cpu_limit_ratio": cpu / limit if limit and cpu is not None else None,
        "worst_rel_error": max(errors),
        "rel_errors": errors,
        "ratio_to_builtin": None,
        "theory_ratio_to_builtin": None,
        "nodes": world_size // ranks_per_node,
        "ranks_per_node": ranks_per_node,
        "inter_node_bytes_per_node": float(statistics.median(inter_node)) if inter_node else None,
        "theory_inter_node_bytes_per_node": node_theory,
        "node_wire_bytes": float(statistics.median(node_wire)) if node_wire else None,
        "auto": auto,
        "predicted_s": None,
    }


def add_ratios(records: list[dict[str, Any]], baseline: str = "builtin") -> None:
    """Fill ``ratio_to_builtin`` (measured median times) and ``theory_ratio_to_builtin``
    (theory bytes per rank; with nodes, per node's link) from the baseline record of the same
    regime and size."""
    base = {(r["regime"], r["size_bytes"]): r for r in records if r["method"] == baseline}
    for record in records:
        ref = base.get((record["regime"], record["size_bytes"]))
        if ref is None:
            continue
        record["ratio_to_builtin"] = record["time_median_s"] / ref["time_median_s"]
        key = "theory_bytes_per_rank" if record.get("ranks_per_node", 1) == 1 else "theory_inter_node_bytes_per_node"
        record["theory_ratio_to_builtin"] = record[key] / ref[key]  # with nodes: the bytes on a node's link


def machine_info() -> dict[str, Any]:
    """Where the numbers came from."""
    memory = None
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    cpu_model = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": memory,
    }


def versions() -> dict[str, Any]:
    import numpy
    import torch

    from cerar.comm.algorithms import native

    return {
        "cerar": __version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": sys.version.split()[0],
        # Whether the ranks' CPU coding is compiled C or torch ops (and why): it sets coding time.
        "cpu_coding": native.status(),
    }


def validate_document(doc: Mapping[str, Any]) -> None:
    """Raise ValueError if ``doc`` does not follow the schema (keys and value types)."""
    for key in TOP_KEYS:
        if key not in doc:
            raise ValueError(f"Argument 'doc' must have the key {key!r}; it has {sorted(doc)}.")
    rate = doc["link_rate_bytes_per_s"]
    if rate is not None and not (isinstance(rate, (int, float)) and rate > 0):
        raise ValueError(f"Argument 'doc' must have a positive or null link rate, not {rate!r}.")
    if not isinstance(doc["results"], list):
        raise ValueError(f"Argument 'doc' must have a list of results, not {type(doc['results']).__name__}.")
    for i, record in enumerate(doc["results"]):
        for key, types in RECORD_KEYS.items():
            if key not in record:
                raise ValueError(f"Result {i} must have the key {key!r}; it has {sorted(record)}.")
            value = record[key]
            if isinstance(value, bool) or not isinstance(value, types):
                names = "/".join("null" if t is type(None) else t.__name__ for t in types)
                raise ValueError(f"Result {i} key {key!r} must be {names}, not {value!r}.")
        if record["regime"] not in ("fast", "slow"):
            raise ValueError(f"Result {i} key 'regime' must be 'fast' or 'slow', not {record['regime']!r}.")
        method = ALL_REDUCE_METHODS.get(record["method"])
        if method is not None and (record["components"] is None) == method.coded:
            raise ValueError(
                f"Result {i} key 'components' must be set exactly for coded methods, not "
                f"{record['components']!r} for {record['method']!r}."
            )
