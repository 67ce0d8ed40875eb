"""benchmarks/gpu_check.py runs its encode/decode/cast path end to end (on the CPU here: CI has no
GPU), so the script a CUDA machine runs is the one the suite keeps working."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cerar import codes

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_check_size_on_cpu_agrees_with_itself_and_times_every_step() -> None:
    row = _load().check_size(codes.perturbed(4, 8), 2, 0.25, iters=1, device="cpu")
    for key in ("copy_ms", "encode_ms", "decode_ms", "fp16_cast_ms", "bf16_cast_ms"):
        assert row[key] > 0, key
    # The same arithmetic on the same device: bitwise equal.
    assert row["encode_rel_diff"] == 0.0
    assert row["decode_rel_diff"] == 0.0


def test_without_cuda_it_says_so_and_exits_0(capsys) -> None:
    module = _load()
    if module.torch.cuda.is_available():  # pragma: no cover - a GPU machine runs the real check
        return
    assert module.main(["--sizes", "1"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.multirank
def test_the_collective_check_runs_on_gloo_and_the_cpu() -> None:
    """The same function a machine with two or more GPUs runs over NCCL, on 2 Gloo ranks."""
    module = _load()
    worst = module.collective_check(2, backend="gloo", device_type="cpu", timeout_s=240)
    assert set(worst) == set(module.COLLECTIVE_LIMITS)
    for name, error in worst.items():
        assert error <= module.COLLECTIVE_LIMITS[name], (name, error)
