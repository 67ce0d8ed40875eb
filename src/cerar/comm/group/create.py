"""Making cerar's process groups: :func:`new_group` (as ``torch.distributed.new_group``), and the
``"cerar"`` backend (:func:`register_backend`, done when :mod:`cerar.group` loads), so that
``dist.init_process_group("cerar")`` and ``dist.new_group(ranks, backend="cerar",
pg_options=GroupSettings(...))`` make one too (torch 2.6 and newer: a backend creator may return
a ``ProcessGroup`` subclass, and its ``new_group`` takes ranks in the group's own numbering).

Either way the group is registered with torch under its name, so ``DeviceMesh.from_group``, the
functional collectives, ``dist.get_process_group_ranks`` and rank translation find it. Its two
inner groups (exact, transport) are made with it: by ``dist.new_group`` from :func:`new_group`
(every rank of the world calls it, as torch's), or, in a backend creator (which only the
members run), straight from the store torch hands it, and registered the same way.
"""

from __future__ import annotations

import atexit
import datetime
import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from cerar._checks import renamed
from cerar.coding.linear_code import MAX_ERROR, Code
from cerar.comm.ddp.state import DEFAULT_MIN_BUCKET_BYTES
from cerar.comm.group.process_group import CerarProcessGroup, GroupSettings
from cerar.comm.runtime.groups import require_initialised
from cerar.comm.runtime.handshake import SettingsMismatchError
from cerar.comm.runtime.links import group_timeout

__all__ = ["BACKEND", "monitored_barrier", "new_group", "register_backend"]

BACKEND = "cerar"


def new_group(
    ranks: Sequence[int] | None = None,
    *,
    method: str = "cerar",
    code: Code | None = None,
    wire_dtype: torch.dtype | None = None,
    max_error: float | None = MAX_ERROR,
    min_bytes: int = DEFAULT_MIN_BUCKET_BYTES,
    nonfinite: str = "exact",
    ranks_per_node: int | None = None,
    timeout: datetime.timedelta | None = None,
    packet_dtype: torch.dtype | None = None,
) -> Any:
    """A :class:`CerarProcessGroup` over ``ranks`` (global ranks; None: the world), as
    ``torch.distributed.new_group``: every rank of the world calls it, in the same order, and
    the others get torch's non-member marker.

    Args:
        method: the coded all-reduces' method, a row of the route table
            (:data:`cerar.comm.collective.routes.ROUTES`): ``"cerar"``, ``"cerar-fp16"``,
            ``"ring"``, ``"ring-fp16"``, ``"ring-int8"``, ``"auto"`` (the fastest within
            ``max_error``, per size), ``"hier-cerar"``, ``"hier-ring"``, ``"hier-ring-int8"``
            (exact inside each node, with ``ranks_per_node``)... The old form, a family with a
            ``wire_dtype`` a row fixes (``method="ring", wire_dtype=torch.int8``) or with
            ``ranks_per_node`` (``method="cerar", ranks_per_node=2``), still works and warns
            (``DeprecationWarning``) naming the row.
        code, wire_dtype, max_error, nonfinite: as :func:`cerar.all_reduce` (``packet_dtype``: the
            deprecated name of ``wire_dtype``; ``nonfinite``
            defaults to ``"exact"``, as the DDP hooks: a gradient with NaN/Inf is summed exactly).
        min_bytes: all-reduces of tensors smaller than this go to the exact group (default 2 MiB,
            the DDP hook's: CERAR's fixed cost per call outweighs the bytes it saves below it).
        ranks_per_node: the hierarchical path, exact inside each node of that many ranks.
        timeout: as ``dist.new_group``'s: how long its inner groups (exact and transport) wait
            for a peer before raising; None: the default group's (``init_process_group(timeout=)``).

    The inner groups take the default group's backend (Gloo on CPU, NCCL on CUDA).
    Bad arguments raise ValueError or TypeError naming the argument and the value, on every rank.
    """
    wire_dtype = renamed("packet_dtype", packet_dtype, "wire_dtype", wire_dtype)
    settings = GroupSettings(method, code, wire_dtype, max_error, min_bytes, nonfinite, ranks_per_node)
    require_initialised()
    world = dist.get_world_size()
    members = _members(ranks, world)
    if ranks_per_node is not None and len(members) % ranks_per_node:
        raise ValueError(f"Argument 'ranks_per_node' must divide the {len(members)} ranks, not {ranks_per_node}.")
    options = {"timeout": check_timeout(timeout), "backend": _inner_backend()}
    exact = dist.new_group(members, **options)
    transport = dist.new_group(members, **options)
    if dist.get_rank() not in members:
        return dist.GroupMember.NON_GROUP_MEMBER
    agree_settings(settings, exact)
    check_code(settings, exact.size())
    group = CerarProcessGroup(exact, transport, settings, exact.rank(), exact.size())
    _register(group, members, f"cerar:{exact.group_name}")
    _adopt_backends(group, exact)
    return group


def check_timeout(timeout: Any) -> datetime.timedelta | None:
    """``timeout`` (a ``datetime.timedelta`` of more than 0), or the default group's for None."""
    if timeout is None:
        return group_timeout(None)
    if not isinstance(timeout, datetime.timedelta) or timeout <= datetime.timedelta(0):
        raise TypeError(f"Argument 'timeout' must be a positive datetime.timedelta or None, not {timeout!r}.")
    return timeout


def monitored_barrier(
    group: Any = None, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False
) -> None:
    """``dist.monitored_barrier`` for any group, cerar's included: a barrier that names the ranks
    that did not reach it within ``timeout``.

    torch runs it on Gloo groups only (it checks ``dist.get_backend(group) == "gloo"``, and a
    cerar group's backend is ``"cerar"``), so a cerar group's runs on its exact group: the same
    ranks, numbered the same, on Gloo. ``timeout``: default the group's own (torch's default is
    Gloo's 30 minutes). Any other group is handed to ``dist.monitored_barrier`` as it is."""
    pg = c10d._get_default_group() if group is None else group
    if isinstance(pg, CerarProcessGroup):
        pg = pg.exact
        timeout = check_timeout(timeout) if timeout is not None else group_timeout(pg)
    dist.monitored_barrier(group=pg, timeout=timeout, wait_all_ranks=wait_all_ranks)


def _members(ranks: Sequence[int] | None, world: int) -> list[int]:
    if ranks is None:
        return list(range(world))
    if isinstance(ranks, (str, bytes)) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        raise TypeError(f"Argument 'ranks' must be a sequence of integers, not {ranks!r}.")
    members = sorted(ranks)
    if not members or len(set(members)) != len(members) or members[0] < 0 or members[-1] >= world:
        raise ValueError(f"Argument 'ranks' must name distinct ranks of the world, 0 to {world - 1}, not {ranks}.")
    return members


def _inner_backend() -> str:
    """The backend of the inner groups: the default group's, unless that is cerar itself."""
    backend = str(dist.get_backend())
    if backend != BACKEND:
        return backend
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def _register(group: dist.ProcessGroup, global_ranks: Sequence[int], name: str, backend: str = BACKEND) -> None:
    """Make torch's helpers know ``group`` as a ``backend`` group of ``global_ranks`` called
    ``name``, as ``dist.new_group`` registers its own (rank translation, ``DeviceMesh``, the
    functional collectives' name and tag registries, ``dist.destroy_process_group``)."""
    group._set_group_name(name)
    c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(global_ranks)}
    c10d._world.pg_names[group] = name
    c10d._world.pg_map[group] = (backend, None)
    c10d._world.pg_backend_config[group] = str(c10d.BackendConfig(dist.Backend(backend)))
    tag = f"ptd:{name}"
    c10d._world.pg_to_tag[group] = tag
    for key in (tag, ""):
        c10d._world.tags_to_pg.setdefault(key, []).append(group)
    c10d._register_process_group(name, group)


def _describe(settings: GroupSettings) -> dict[str, Any]:
    """The settings as plain values that compare equal exactly when the groups would send alike."""
    code = settings.code
    return {
        "method": settings.method,
        "code": None if code is None else f"{code!r} fingerprint={code.fingerprint}",
        "wire_dtype": None if settings.wire_dtype is None else str(settings.wire_dtype),
        "max_error": settings.max_error,
        "min_bytes": settings.min_bytes,
        "nonfinite": settings.nonfinite,
        "ranks_per_node": settings.ranks_per_node,
    }


def agree_settings(settings: GroupSettings, exact: dist.ProcessGroup) -> None:
    """Check that every member made its group with the same settings (one all-gather on the new
    exact group, before the group is used): ranks that differ in ``min_bytes`` or ``max_error``
    would otherwise route or code the same call differently and wait for the timeout. Raises
    :class:`SettingsMismatchError` on every rank, naming each differing setting and each rank's value."""
    mine = torch.frombuffer(bytearray(json.dumps(_describe(settings), sort_keys=True).encode()), dtype=torch.uint8)
    size = exact.size()
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    exact.allgather([lengths], [torch.tensor([mine.numel()], dtype=torch.int64)]).wait()
    longest = int(max(int(n) for n in lengths))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: mine.numel()] = mine
    texts = [torch.zeros(longest, dtype=torch.uint8) for _ in range(size)]
    exact.allgather([texts], [padded]).wait()
    every = [json.loads(bytes(t[: int(n)].tolist()).decode()) for t, n in zip(texts, lengths, strict=True)]
    differing = [key for key in every[0] if any(d.get(key) != every[0][key] for d in every)]
    if differing:
        details = "; ".join(
            f"{key}: " + ", ".join(f"rank {r}: {d.get(key)!r}" for r, d in enumerate(every)) for key in differing
        )
        raise SettingsMismatchError(
            f"cerar: the ranks made the group with different settings (group ranks): {details}. Every rank must "
            "pass the same settings."
        )


def check_code(settings: GroupSettings, size: int) -> None:
    """Refuse, when the group is made, what its coded calls would refuse: a code for the wrong
    number of ranks (nodes), or one that cannot meet ``max_error`` at the group's packet
    precision, the given one or, without one, the default (for float32 tensors: float64 ones get
    a code at least as accurate) by the route's one rule (:meth:`Route.code_for`), and a row
    whose predicted error exceeds ``max_error``. A ValueError names the figures, on every rank
    (the settings are agreed first), as ``cerar.all_reduce`` refuses them."""
    route = settings.route
    ranks = size // (settings.ranks_per_node or 1)  # the code's ranks: the nodes on the hierarchical path
    call = settings.call_settings()
    route.check_error(ranks, settings.max_error)
    route.code_for(ranks, torch.float32, call)


def _adopt_backends(group: dist.ProcessGroup, exact: dist.ProcessGroup) -> None:
    """Give ``group`` the exact group's backends (Gloo for CPU, NCCL for CUDA where there is one)
    as its own, as torch's groups have: the C++ ops that look a group's backend up by device (the
    functional collectives' ``*_out`` forms and ``_c10d_functional`` ops resolved by name, the
    coalescing manager) then run on the exact group instead of raising "No backend type
    associated with device type cpu". The group's own methods (``allreduce``, DDP's calls,
    ``dist.*``) are Python overrides and keep their routing.

    The exact group is then kept until the interpreter exits (:data:`_KEPT`): whoever let go of
    ``group`` last would otherwise destroy those backends, and two of its holders must not.
    DDP's reducer frees its group with the GIL held, and a Gloo worker still retiring the last
    call (freeing a tensor Python no longer holds takes the GIL) holds the lock the destructor
    waits for: the process hung at exit. A callback on a Gloo worker that held the last
    reference made the backend join the thread it ran on: the process aborted. Released at
    exit, by Python, the GIL is let go while they are destroyed."""
    devices = [("cpu", dist.ProcessGroup.BackendType.GLOO)]
    if torch.cuda.is_available() and dist.is_nccl_available():
        devices.append(("cuda", dist.ProcessGroup.BackendType.NCCL))
    adopted = False
    for device, kind in devices:
        try:
            backend = exact._get_backend(torch.device(device))
        except RuntimeError:  # the exact group has none for this device
            continue
        group._register_backend(torch.device(device), kind, backend)
        if not adopted:
            group._set_default_backend(kind)
            adopted = True
    if not _KEPT:
        atexit.register(_KEPT.clear)
    _KEPT.append(exact)


_KEPT: list[dist.ProcessGroup] = []  # exact groups whose backends a cerar group adopted (see above)


_DEFAULTS = [GroupSettings()]  # the backend's groups made without pg_options


def register_backend(**settings: Any) -> None:
    """Register the ``"cerar"`` backend with torch.distributed (once; :mod:`cerar.group` does it
    when it loads). ``settings`` (:func:`new_group`'s keywords but ``ranks``) become the settings
    of the groups it makes without ``pg_options``, as ``init_process_group("cerar")`` does."""
    if settings:
        _DEFAULTS[0] = GroupSettings(**settings)
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def _create(options: Any, settings: Any) -> CerarProcessGroup:
    """The backend's creator: only the members run it, so its inner groups are made from the
    store torch hands it (not by ``dist.new_group``), and registered."""
    settings = _DEFAULTS[0] if settings is None else settings
    if not isinstance(settings, GroupSettings):
        raise TypeError(f"Argument 'pg_options' of a cerar group must be GroupSettings, not {type(settings).__name__}.")
    rank, size, store = options.group_rank, options.group_size, options.store
    global_ranks = list(options.global_ranks_in_group) or list(range(size))
    inner = []
    for part in ("exact", "transport"):
        inner.append(_store_group(c10d.PrefixStore(f"cerar-{part}/", store), rank, size, options.timeout))
        _register(inner[-1], global_ranks, f"{options.group_id}:cerar-{part}", _store_backend())
    agree_settings(settings, inner[0])
    check_code(settings, size)
    group = CerarProcessGroup(inner[0], inner[1], settings, rank, size)
    _adopt_backends(group, inner[0])
    return group


def _store_backend() -> str:
    """What :func:`_store_group`'s groups run: Gloo, and NCCL for CUDA tensors where there is a GPU."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _store_group(store: Any, rank: int, size: int, timeout: Any) -> dist.ProcessGroup:
    """A plain group of Gloo (and NCCL for CUDA tensors, where there is a GPU) made from ``store``."""
    group = dist.ProcessGroup(store, rank, size)
    gloo = c10d.ProcessGroupGloo(c10d.PrefixStore("cpu/", store), rank, size, timeout)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    if torch.cuda.is_available() and dist.is_nccl_available():
        nccl_options = c10d.ProcessGroupNCCL.Options()
        nccl_options._timeout = timeout
        nccl = c10d.ProcessGroupNCCL(c10d.PrefixStore("cuda/", store), rank, size, nccl_options)
        group._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
    return group
