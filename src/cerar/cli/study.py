"""``cerar study``: the paper-style accuracy figures (PNG) and their data (JSON).

Writes, under ``--out`` (default ``results/study``):

* ``slopes.png`` / ``slopes.json``: error and cond against ``eps`` for each construction
  (float64 packets, log-log, fitted slopes against the predicted ``1`` and ``-r``);
* ``tradeoff.png`` / ``tradeoff.json``: bytes per element against worst-rank error at float32 and
  float64 for ``N = 4, 8, 16`` (perturbed, perturbed with its seam spread, optimized), with the
  float16/bfloat16 ring errors and the float32/float16 exact ring's bytes as reference lines.

Optimised designs come from the on-disk cache after the first run (the first run of the full
study spends about a minute optimising). ``--quick`` runs a small version (``N = 4``) in seconds.

``--gradients`` measures real gradients instead (:mod:`cerar.experiments.study.capture`,
:mod:`cerar.experiments.study.gradients`): it trains the ``cerar train`` model on ``--world-size`` local ranks
(default 4) for ``--steps`` updates (default 160) with exact averaging, captures every rank's
local gradient at ``--capture-steps`` (default start, middle, end), and writes

* ``gradients_capture.npz``: the captured gradients (reuse them with ``--capture PATH``, which
  skips training);
* ``gradients.json`` / ``gradients.png``: each method's bytes per element and worst/mean-rank
  error on the gradients of every point and on i.i.d. data of the same size (CERAR ``c = 2N, 3N``
  with each construction, the float32/float16/bfloat16 rings), and how shared the gradients are;
  beside each bucket figure, the worst error relative to each parameter's own sum (and the
  absolute error where a parameter's or a value's true sum is zero). The parameter layout comes
  from the capture; a capture saved before it stored one gets it rebuilt from its model config
  when transformers is installed, else the per-parameter figures are left out.

With ``--quick`` it trains a tiny model for 10 steps: a smoke test.

``--frontier`` draws bytes per value against worst-rank error (:mod:`cerar.experiments.study.frontier`)
for ``--world-sizes`` (default 4, 8, 16) on i.i.d. Gaussian inputs of ``--values`` values per rank
(default 65536, median of 3 seeds): the float32/float16/bfloat16 rings, the int8 and e4m3 rings at
each block size (int4 and the narrower block wires at 8-128), the direct shape of every block wire
at the same formats (the ring's bytes), CERAR at ``c = N+1, 3N/2, 2N, 3N`` with
float32/float16/bfloat16 packets and over 8-bit packets, the Pareto frontier marked, and CERAR's
``wrap``, ``A`` and ``K`` table; it writes ``frontier.json`` and ``frontier.png`` (a few minutes on
two cores; ``--quick``: N = 4, seconds). It prints the Pareto frontier's points, CERAR's 8-bit
ones, and every block wire's ring and direct shape as the route table runs them (each wire's
default block and bfloat16 scales: int8 and e4m3 in blocks of 64, int4 of 32) side by side,
"(the row's format)"; the plot marks the rings of the wires narrower than 8 bits "ring int4/...
(blocks)" and the direct shape's points as a series per wire, "direct int8 (blocks)"...
``--blocks`` writes ``blocks.json``, the block rings' block-size table for the wires of ``--wires``
(default ``int8,fp8``; ``int8,fp8,int4`` adds the 4-bit ring's): every block size (32-1024 for
the 8-bit wires, 8-128 for the narrower ones) and scale dtype at ``N = 4``, three block sizes
around the wire's default at ``N = 8, 16``; three inputs; ``--values`` default 1048576, 3 seeds;
``--quick``: ``N = 4`` only, seconds).

``--feedback`` measures error feedback (:mod:`cerar.experiments.study.feedback`, the numpy
reference of ``cerar.all_reduce(..., error_feedback=)``, bitwise the collective's): ``--world-size``
ranks (default 4) each all-reduce one fixed gradient (Gaussian, and Student-t(3)) of ``--values``
values (default 65536) ``--calls`` times (default 100), with and without error feedback, for the
block wires of ``--wires`` (default: every one) in both shapes (``ring-<wire>``,
``direct-<wire>``). It writes ``feedback.json`` (the running sum's relative error after each
call, ``err(k) = ||sum_{i<=k} out_i - k S|| / (k ||S||)``) and ``feedback.png`` (``err(k)``
against ``k``, log-log, solid with error feedback, dashed without), and prints per wire and shape
``err(1)``, ``err(calls)`` without and with feedback and the fitted slope of ``log err`` against
``log k`` from call 10 on (``--quick``: 4096 values, 20 calls).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from cerar._checks import check_int
from cerar.cli._paths import output_folder
from cerar.coding.constructions import MAX_COMPONENTS
from cerar.coding.optimize import OPTIMIZED_MAX_COMPONENTS
from cerar.experiments.study import synthetic as study
from cerar.harness import resources

#: The trade-off's ``c = multiple x N`` (``--quick``: two of them).
MULTIPLES = (1.5, 2, 3, 4)
QUICK_MULTIPLES = (2, 3)
#: Working memory (bytes) of the slope study per value of ``--size`` (its largest simulation,
#: ``N = 4``, ``c = 12``, and every input; measured 3.7 KB), and of the trade-off per ``N^2 x size``
#: (its largest ``c = 4N``; measured 340-420 bytes), rounded up.
SLOPE_BYTES_PER_SIZE = 4096
TRADEOFF_BYTES_PER_SIZE = 512


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("study", help="accuracy figures: error/cond vs eps, bytes vs error (PNG + JSON)")
    p.add_argument("--out", type=Path, default=Path("results/study"), help="folder (default results/study)")
    p.add_argument("--world-sizes", "-N", type=int, nargs="+", default=[4, 8, 16], help="ranks, trade-off")
    p.add_argument("--size", type=int, default=256, help="values per component per simulation (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="N = 4 only, small inputs: a smoke test in seconds")
    g = p.add_argument_group("real gradients (--gradients)")
    g.add_argument("--gradients", action="store_true", help="measure captured training gradients instead")
    g.add_argument("--world-size", type=int, default=4, help="ranks of the capture run and of --feedback (default 4)")
    g.add_argument("--steps", type=int, default=160, help="training updates (default 160)")
    g.add_argument("--capture-steps", type=int, nargs="+", default=None,
                   help="steps in [0, steps] to capture (default: 0, steps // 2, steps)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (default 8)")
    g.add_argument("--capture", type=Path, default=None, help="reuse this saved capture (.npz): no training")
    f = p.add_argument_group("block wires (--frontier, --blocks, --feedback)")
    f.add_argument("--frontier", action="store_true", help="bytes per value against error: rings and CERAR")
    f.add_argument("--blocks", action="store_true", help="the block rings' block-size table (blocks.json)")
    f.add_argument("--feedback", action="store_true",
                   help="error feedback: the sum over --calls calls of one gradient, with and without (feedback.json)")
    f.add_argument("--wires", nargs="+", default=None, metavar="WIRE",
                   help="--blocks, --feedback: the block wires, comma or space separated "
                   "(default int8,fp8 for --blocks, every block wire for --feedback)")
    f.add_argument("--values", type=int, default=None,
                   help="values per rank (default 65536 for --frontier and --feedback, 1048576 for --blocks)")
    f.add_argument("--calls", type=int, default=100, help="--feedback: calls of each stream (default 100)")
    f.add_argument("--seeds", type=int, default=3, help="seeds per measurement, median taken (default 3)")
    resources.add_override_flag(p)


def _write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def run(args: argparse.Namespace) -> int:
    from cerar.experiments._extras import require

    check_int("seed", args.seed, minimum=0)  # numpy's own refusal names no argument
    # Before the work: the figures come last, a missing extra should not cost the study's time.
    require("matplotlib", "bench", needed_by="cerar study")
    feedback = getattr(args, "feedback", False)
    if getattr(args, "frontier", False) or getattr(args, "blocks", False):
        code = _run_frontier(args)
        return _run_feedback(args) if feedback and code == 0 else code
    if feedback:
        return _run_feedback(args)
    if getattr(args, "gradients", False):
        if args.capture is None:  # training the model to capture its gradients
            require("transformers", "train", needed_by="cerar study --gradients")
        return _run_gradients(args)
    world_sizes = [4] if args.quick else list(args.world_sizes)
    size = 64 if args.quick else args.size
    multiples = QUICK_MULTIPLES if args.quick else MULTIPLES
    _check_synthetic(world_sizes, size, multiples, args.allow_oversubscribe)
    out = output_folder("out", args.out)

    started = time.perf_counter()
    slopes = study.slope_study(4, size=max(size, 256), seed=args.seed)
    _write(out / "slopes.json", slopes)
    study.plot_slopes(slopes, out / "slopes.png")
    for label, s in slopes["series"].items():
        print(
            f"{label:>25}: error slope {s['error_slope']:.3f} (theory {s['predicted_error_slope']:.0f}), "
            f"cond slope {s['cond_slope']:.3f} (theory {s['predicted_cond_slope']:.0f})"
        )

    tradeoff = study.tradeoff_study(world_sizes, multiples, ("fp32", "fp64", "fp16", "bf16"), size, args.seed)
    _write(out / "tradeoff.json", tradeoff)
    study.plot_tradeoff(tradeoff, out / "tradeoff.png")
    for point in tradeoff["points"]:
        if point["precision"] == "fp32":
            print(
                f"N={point['world_size']:>2} c={point['components']:>3} {point['design']:>16} fp32: "
                f"{point['bytes_per_element']:.2f} B/elem, worst-rank error {point['error']:.3g}"
            )
    elapsed = time.perf_counter() - started
    print(f"wrote {out}/slopes.{{png,json}} and {out}/tradeoff.{{png,json}} in {elapsed:.0f} s")
    return 0


#: Working memory (bytes) of the frontier per value per rank and rank (inputs of 3 seeds in float32,
#: a simulation's float64 copies; measured about 200), rounded up.
FRONTIER_BYTES_PER_VALUE = 256


def _wires(given: list[str]) -> tuple[str, ...]:
    """``--wires``' names (each item comma separated, repeats dropped), checked against the block
    wires."""
    from cerar.coding.blocks import WIRES

    names = tuple(dict.fromkeys(w.strip() for item in given for w in item.split(",") if w.strip()))
    bad = [w for w in names if w not in WIRES]
    if not names or bad:
        raise ValueError(f"Argument 'wires' must name block wires among {', '.join(WIRES)}, not {','.join(given)!r}.")
    return names


def _values(args: argparse.Namespace, default: int) -> int:
    """``--values``, else ``default`` (4096 with ``--quick``): a given 0 is refused, not replaced."""
    return (4096 if args.quick else default) if args.values is None else args.values


def _run_frontier(args: argparse.Namespace) -> int:
    """``--frontier`` and/or ``--blocks``: the block wires' measurements, JSON (+ PNG)."""
    from cerar.experiments.study import frontier

    wires = _wires(getattr(args, "wires", None) or ["int8,fp8"])  # --blocks' default: the 8-bit wires
    seeds = 1 if args.quick else check_int("seeds", args.seeds, minimum=1)
    world_sizes = [4] if args.quick else list(args.world_sizes)
    for n in world_sizes:
        if not isinstance(n, int) or n < 3 or n > 21:  # optimized stops at c = 64 = 3N
            raise ValueError(f"Argument 'world_sizes' must hold integers from 3 to 21, not {n!r}.")
    out = output_folder("out", args.out)
    started = time.perf_counter()
    if args.blocks:
        values = check_int("values", _values(args, 1 << 20), minimum=64)
        largest = 4 if args.quick else 16
        resources.check_memory("values", values, FRONTIER_BYTES_PER_VALUE * largest * values,
                               f"block rings of N = {largest} at {values} values", allow=args.allow_oversubscribe)
        rows = frontier.block_tables(wires, size=values, seeds=seeds, quick=args.quick)
        _write(out / "blocks.json", {"rows": rows, "values": values, "seeds": seeds, "wires": list(wires)})
        for r in rows:
            errors = " ".join(f"{k} {v:.2e}" for k, v in r["errors"].items())
            print(f"N={r['world_size']:>2} {r['wire']} B={r['block']:>4} {r['scale']}: "
                  f"{r['bytes_per_value']:.4f} B/value, {errors} (bound {r['bound']:.2e})")  # fmt: skip
    if args.frontier:
        values = check_int("values", _values(args, 1 << 16), minimum=64)
        n = max(world_sizes)
        resources.check_memory("values", values, FRONTIER_BYTES_PER_VALUE * n * values,
                               f"simulations of N = {n} at {values} values", allow=args.allow_oversubscribe)
        blocks = (32, 64, 256) if args.quick else frontier.BLOCKS  # 64: the 8-bit rows' own block
        result = frontier.frontier_study(world_sizes, size=values, seeds=seeds, blocks=blocks)
        _write(out / "frontier.json", result)
        frontier.plot_frontier(result, out / "frontier.png")
        shown = {id(p) for p in frontier.default_format_points(result["points"])}
        for p in sorted(result["points"], key=lambda p: (p["world_size"], p["bytes_per_value"])):
            if p["on_frontier"] or p["kind"] == "cerar8" or id(p) in shown:
                mark = ("frontier " if p["on_frontier"] else "") + ("(the row's format)" if id(p) in shown else "")
                print(f"N={p['world_size']:>2} {p['label']:<28} {p['bytes_per_value']:.3f} B/value, "
                      f"error {p['error']:.2e} {mark}".rstrip())  # fmt: skip
    elapsed = time.perf_counter() - started
    print(f"wrote {out} in {elapsed:.0f} s")
    return 0


#: Working memory (bytes) of the feedback study per value per rank (the inputs, residuals and a
#: call's float32 temporaries, a running sum in float64), rounded up.
FEEDBACK_BYTES_PER_VALUE = 128


def _run_feedback(args: argparse.Namespace) -> int:
    """``--feedback``: the running sum's error over many calls with and without error feedback,
    JSON + PNG and the table."""
    from cerar.coding.blocks import WIRES
    from cerar.experiments.study import feedback

    wires = _wires(args.wires) if getattr(args, "wires", None) else WIRES
    n = check_int("world_size", getattr(args, "world_size", 4), minimum=2)
    values = check_int("values", _values(args, 1 << 16), minimum=1)
    calls = 20 if args.quick else check_int("calls", getattr(args, "calls", 100), minimum=2)
    resources.check_memory("values", values, FEEDBACK_BYTES_PER_VALUE * n * values,
                           f"{n} ranks' streams of {values} values", allow=args.allow_oversubscribe)  # fmt: skip
    out = output_folder("out", args.out)
    started = time.perf_counter()
    result = feedback.feedback_study(n, values, calls, seed=args.seed, wires=wires)
    _write(out / "feedback.json", result)
    feedback.plot_feedback(result, out / "feedback.png")
    print(f"N = {n}, {values} values per rank, one fixed gradient per rank, {calls} calls; relative error of the "
          f"sum over k calls, err(k) = ||sum out - k S|| / (k ||S||):")  # fmt: skip
    print(feedback.feedback_table(result))
    elapsed = time.perf_counter() - started
    print(f"wrote {out}/feedback.{{png,json}} in {elapsed:.0f} s")
    return 0


def _check_synthetic(world_sizes: list[int], size: int, multiples: tuple[float, ...], allow: bool) -> None:
    """Refuse what the synthetic study cannot build or hold, before it starts: ``N`` below 3,
    codes beyond the constructions' limits (the optimized design stops at ``c = 64``, the
    perturbed at 256), a ``--size`` whose simulations exceed the machine's memory."""
    for n in world_sizes:
        if not isinstance(n, int) or n < 3:
            raise ValueError(f"Argument 'world_sizes' must hold integers of at least 3, not {n!r}.")
    if size < 1:
        raise ValueError(f"Argument 'size' must be at least 1, not {size}.")
    largest = max(multiples)
    limit = min(OPTIMIZED_MAX_COMPONENTS, MAX_COMPONENTS)  # every design is drawn at every N
    for n in world_sizes:
        if round(largest * n) > limit:
            raise ValueError(
                f"Argument 'world_sizes' must hold integers of at most {int(limit // largest)} (the trade-off "
                f"builds c = {largest:g}N with the optimized design, which stops at c = {limit}), not {n}."
            )
    n = max(world_sizes)
    needed = max(SLOPE_BYTES_PER_SIZE * max(size, 256), TRADEOFF_BYTES_PER_SIZE * n * n * size)
    what = f"simulations of N = {n} at {size} values per component"
    resources.check_memory("size", size, needed, what, allow=allow)


def _parameter_layout(capture: Any) -> tuple[Any, str]:
    """The capture's parameter layout and where it came from: the file, else the model rebuilt
    from the capture's config (older files), else None with the reason."""
    import importlib.util

    from cerar.experiments.study import capture as gradient_capture

    if capture.parameters is not None:
        return capture.parameters, "capture"
    if importlib.util.find_spec("transformers") is None:
        return None, "the capture has no parameter layout and transformers is not installed to rebuild it"
    layout = gradient_capture.model_parameters(capture.config.model, capture.config.seed)
    if sum(size for _, size in layout) != capture.size:
        return None, "the capture has no parameter layout and its model config does not rebuild one of its size"
    return layout, "model config (rebuilt)"


def _check_capture_run(args: argparse.Namespace, model: Any, steps: int) -> None:
    """Refuse a capture run with bad settings, or that this machine cannot start or hold
    (``--allow-oversubscribe``: try): its ranks train ``model``, and rank 0 gathers every
    capture point's ``N`` gradients."""
    from cerar.experiments.study.capture import check_capture_steps, default_capture_steps
    from cerar.experiments.train.memory import parameters, rank_bytes

    allow = args.allow_oversubscribe
    check_int("batch_size", args.batch_size, minimum=1)
    if args.capture_steps is None:
        points = len(default_capture_steps(steps))  # checks steps
    else:
        points = len(check_capture_steps(args.capture_steps, check_int("steps", steps, minimum=1)))
    resources.check_ranks("world_size", args.world_size, allow=allow)
    gathered = 2 * 4 * points * args.world_size * parameters(model)  # float32, and its copy into the file
    per_rank = resources.RANK_PROCESS_BYTES + rank_bytes(model, args.batch_size)
    what = f"{args.world_size} ranks on {args.batch_size} sequences each"
    resources.check_memory("batch_size", args.batch_size, args.world_size * per_rank + gathered, what, allow=allow)


def _run_gradients(args: argparse.Namespace) -> int:
    """``--gradients``: capture (or load) real gradients, measure every method, write JSON + PNG."""
    from cerar.experiments.study import capture as gradient_capture
    from cerar.experiments.study import gradients as gradient_study
    from cerar.experiments.train.config import ModelConfig
    from cerar.harness.progress import parse_progress

    started = time.perf_counter()
    if args.capture is not None:
        capture = gradient_capture.load_capture(args.capture, name="capture")
        out = output_folder("out", args.out)
        source = str(args.capture)
    else:
        if args.world_size < 3:
            # N = 2 has no wrap (both ranks decode exactly): nothing for the study to show.
            raise ValueError(f"Argument 'world_size' must be at least 3, not {args.world_size}.")
        steps = 10 if args.quick else args.steps
        model = ModelConfig(layers=1, hidden=32, heads=2, seq_len=32) if args.quick else ModelConfig()
        _check_capture_run(args, model, steps)
        out = output_folder("out", args.out)
        path = out / "gradients_capture.npz"

        def echo(rank: int, stream: str, line: str) -> None:
            progress = parse_progress(line, gradient_capture.PROGRESS_KIND) if stream == "stdout" else None
            if progress is not None and (progress.done % 20 == 0 or progress.done == progress.total):
                loss = float(progress.detail)
                print(f"  step {progress.done}/{progress.total} loss {loss:.3f}", flush=True)

        print(f"training on {args.world_size} ranks for {steps} steps, capturing local gradients ...", flush=True)
        capture = gradient_capture.capture_gradients(
            args.world_size, steps, args.capture_steps, model, path,
            batch_size=args.batch_size, seed=args.seed, on_line=echo,
        )  # fmt: skip
        source = str(path)
    datasets = {f"step {s}": capture.gradients[p] for p, s in enumerate(capture.steps)}
    parameters, layout_source = _parameter_layout(capture)
    info = {
        "capture": source,
        "steps": list(capture.steps),
        "train_config": capture.config.to_dict(),
        "local_losses": capture.losses.tolist(),
        "parameters_from": layout_source,
    }
    result = gradient_study.gradient_study(datasets, seed=args.seed, info=info, parameters=parameters)
    _write(out / "gradients.json", result)
    gradient_study.plot_gradient_study(result, out / "gradients.png")
    print(f"N = {capture.world_size}, d = {capture.size:,}; worst-rank relative error:")
    print(gradient_study.method_table(result, "worst"))
    if parameters is not None:
        print(f"per parameter ({len(parameters)} parameters, layout from the {layout_source}):")
        print(gradient_study.parameter_table(result))
    else:
        print(f"no per-parameter figures: {layout_source}")
    elapsed = time.perf_counter() - started
    print(f"wrote {out}/gradients.{{png,json}} in {elapsed:.0f} s")
    return 0
