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


def test_its_kernels_agree_with_an_independent_float64_reference() -> None:
    """The encode and decode the script times, on the CPU, against numpy in float64 from the
    plan's matrices (not against themselves): the last round's packet is the sum of every
    round's increment, and the sum is ``D X + W R``."""
    import numpy as np

    module = _load()
    code, rank, m = codes.perturbed(4, 8), 2, 5000
    c = code.components
    plan = module.rank_matrices(code, rank, module.torch.device("cpu"))
    generator = module.torch.Generator().manual_seed(0)
    own = module.torch.randn(m, c, generator=generator)
    obs = module.torch.randn(c, m, generator=generator)
    rows = plan.increments.float()
    packets = module._encode(rows, own, module.torch.empty(2, m))
    last = packets[rows.shape[0] % 2].double().numpy()
    expected = plan.increments.numpy().sum(axis=0) @ own.double().numpy().T
    assert np.linalg.norm(last - expected) <= 1e-5 * np.linalg.norm(expected)
    total = module._decode(plan, own, obs, module.torch.empty(c, m, dtype=module.torch.float64)).numpy()
    reference = plan.decode_own.numpy() @ own.double().numpy().T + plan.decode_obs.numpy() @ obs.double().numpy()
    assert np.linalg.norm(total - reference) <= 1e-6 * np.linalg.norm(reference)
