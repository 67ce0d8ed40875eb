"""The code constructions, as users know them (``cerar.codes``), and their one registry.

``exact``, ``perturbed`` and ``vandermonde`` live in :mod:`cerar.coding.constructions`,
``optimized`` in :mod:`cerar.coding.optimize` and ``choose`` in :mod:`cerar.coding.choose`; this
module re-exports them and holds :data:`CONSTRUCTIONS`, the table every command that takes a
construction by name (``cerar design``, the benchmark, the studies) builds its codes from, so that
a new construction is added in one place. Pure numpy/scipy: never imports torch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from cerar._checks import check_choice
from cerar.coding.choose import choose
from cerar.coding.constructions import MAX_COMPONENTS, check_design, cluster_sizes, exact, perturbed, vandermonde
from cerar.coding.linear_code import MAX_ERROR, Code, check_max_error
from cerar.coding.optimize import OPTIMIZED_MAX_COMPONENTS, optimized

__all__ = [
    "CONSTRUCTIONS",
    "MAX_COMPONENTS",
    "MAX_ERROR",
    "OPTIMIZED_MAX_COMPONENTS",
    "build",
    "choose",
    "cluster_sizes",
    "exact",
    "optimized",
    "perturbed",
    "vandermonde",
]


def _perturbed(
    world_size: int,
    components: int,
    precision: Any = "fp32",
    *,
    delta: float | None = None,
    reference: str = "mixed",
    spread_seam: bool = False,
    max_error: float | None = MAX_ERROR,
) -> Code:
    return perturbed(
        world_size, components, delta, precision, reference=reference, spread_seam=spread_seam, max_error=max_error
    )


def _vandermonde(
    world_size: int,
    components: int,
    precision: Any = "fp32",
    *,
    eps: float | None = None,
    reference: str = "mixed",
    max_error: float | None = MAX_ERROR,
) -> Code:
    return vandermonde(world_size, components, eps, precision, reference=reference, max_error=max_error)


def _exact(world_size: int, components: int, precision: Any = "fp32", *, max_error: float | None = MAX_ERROR) -> Code:
    # exact has nothing to tune, but a bad precision is still an error.
    world_size, components, precision = check_design(world_size, components, precision)
    max_error = check_max_error(max_error)
    if components != world_size:
        raise ValueError(
            f"Argument 'components' must equal world_size ({world_size}) for construction 'exact', not {components}."
        )
    return exact(world_size).check_error(precision, max_error)


#: Every construction by name, called as ``CONSTRUCTIONS[name](world_size, components, precision,
#: **options)``, its tuning left to the library unless an option sets it. Options: ``delta``,
#: ``spread_seam`` and ``reference`` (perturbed), ``eps`` and ``reference`` (vandermonde),
#: ``kappa``, ``refine`` and ``cache`` (optimized); :func:`build` adds ``reference`` to all, and every
#: one takes ``max_error`` (default :data:`MAX_ERROR`, 0.1: a code whose predicted worst-rank error at
#: ``precision`` exceeds it is refused with a ValueError; None builds it anyway).
#: ``exact`` needs ``components == world_size``. Listed in the order commands show them: tuned
#: constructions first, the exact code last.
CONSTRUCTIONS: dict[str, Callable[..., Code]] = {
    "perturbed": _perturbed,
    "optimized": optimized,
    "vandermonde": _vandermonde,
    "exact": _exact,
}


def build(name: str, world_size: int, components: int, precision: Any = "fp32", **options: Any) -> Code:
    """The code of construction ``name`` (a key of :data:`CONSTRUCTIONS`) for ``N`` ranks and
    ``c`` components with packets in ``precision``.

    ``options`` are the construction's own keywords (see :data:`CONSTRUCTIONS`), plus
    ``reference`` for every construction: one that tunes itself takes it while tuning (perturbed's
    automatic delta depends on the decoder), the others (``exact``, ``optimized``, designed for
    the mixed decoder) get it by :meth:`Code.with_reference` on the same nodes. An option the
    construction does not take is a TypeError naming it, rather than silently ignored.
    """
    builder = CONSTRUCTIONS[check_choice("name", name, CONSTRUCTIONS)]
    takes = [p for p in inspect.signature(builder).parameters if p not in ("world_size", "components", "precision")]
    for option in options:
        if option not in (*takes, "reference"):
            listed = ", ".join(sorted({*takes, "reference"}))
            raise TypeError(f"Argument {option!r} does not apply to construction {name!r}, which takes {listed}.")
    if "reference" in takes:
        return builder(world_size, components, precision, **options)
    reference = options.pop("reference", "mixed")
    if reference == "mixed":
        return builder(world_size, components, precision, **options)
    # The limit applies to the code returned, i.e. with the decoder asked for.
    max_error = check_max_error(options.pop("max_error", MAX_ERROR))
    code = builder(world_size, components, precision, max_error=None, **options)
    code = code if reference == code.reference else code.with_reference(reference)
    return code.check_error(precision, max_error)
