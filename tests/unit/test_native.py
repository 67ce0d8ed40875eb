"""cerar.comm.native: the compiled decode against an independent float64 reference (numpy), and
its build: cached, atomic, and off with a reason where it cannot be had."""

from __future__ import annotations

import multiprocessing
import shutil
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch

from cerar.comm import native

_PACKETS = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A process that has not tried the build yet, with its own cache folder."""
    monkeypatch.setattr(native, "_status", None)
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setenv("CERAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CERAR_NATIVE", raising=False)
    return tmp_path / "cache"


def _decoder(
    c: int, seed: int, packet: torch.dtype = torch.float32
) -> tuple[native.FusedDecoder, np.ndarray, np.ndarray]:
    """A decoder for random ``D`` and ``W`` with entries up to ~1e3 whose terms cancel, as a
    real code's do (the decoded sum is far smaller than its terms)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None and shutil.which("clang") is None:
        pytest.skip("no C compiler: the torch ops run instead (tested in the multi-rank suites)")
    rng = np.random.default_rng(seed)
    d = rng.standard_normal((c, c)) * 10.0 ** rng.uniform(0, 3, (c, c))
    w = rng.standard_normal((c, c)) * 10.0 ** rng.uniform(0, 3, (c, c))
    decoder = native.fused_decoder(torch.from_numpy(d), torch.from_numpy(w), torch.float32, packet, torch.device("cpu"))
    assert decoder is not None, native.status()  # a compiler is here: the build must work
    return decoder, d, w


def _observations(c: int, width: int, ld: int, offset: int, packet: torch.dtype, seed: int) -> torch.Tensor:
    """``c`` slots of ``width`` values, ``ld`` apart, starting ``offset`` into their buffer (as the
    engine's slots sit behind the maxima chain's front), over many binades."""
    g = torch.Generator().manual_seed(seed)
    buffer = torch.randn(c, ld, generator=g) * torch.exp2(torch.randint(-12, 12, (c, ld), generator=g).float())
    return buffer.to(packet)[:, offset : offset + width]


def _reference(d: np.ndarray, w: np.ndarray, rows: np.ndarray, obs: np.ndarray, scale: float) -> np.ndarray:
    return ((d @ rows.T + w @ obs) * scale).T


@pytest.mark.parametrize("packet", _PACKETS)
@pytest.mark.parametrize("c", [4, 5, 8, 16, 24, 32])
def test_decode_matches_the_float64_reference(packet: torch.dtype, c: int) -> None:
    decoder, d, w = _decoder(c, seed=c, packet=packet)
    width = 3001  # several of the 16-bit path's blocks of columns, the last one partial
    rows = torch.randn(width, c, generator=torch.Generator().manual_seed(1))
    obs = _observations(c, width, ld=width + 40, offset=24, packet=packet, seed=2)
    scale = 2.0**-3
    out = torch.empty(width, c)
    decoder.decode(rows, obs, scale, out)
    obs64 = obs.double().numpy()  # the packets widened exactly, subnormals of float16 included
    expected = _reference(d, w, rows.double().numpy(), obs64, scale)
    terms = (np.abs(d) @ np.abs(rows.double().numpy()).T + np.abs(w) @ np.abs(obs64)).T * scale
    error = np.abs(out.double().numpy() - expected)
    if packet != torch.float32:  # accumulated in float32 (the packets' rounding dwarfs it)
        assert np.all(error <= 2.0**-24 * np.abs(expected) + 2.0**-22 * 2 * c * terms)
        return
    # float32 packets: rounded once to float32 from a float64 sum, within one float32 rounding of
    # the result plus float64's error on the terms, which cancel ~1e3-fold.
    assert np.all(error <= 2.0**-24 * np.abs(expected) + 1e-13 * terms)
    # The same sum accumulated in float32 misses that tolerance: the test can tell.
    single = ((torch.from_numpy(d).float() @ rows.T + torch.from_numpy(w).float() @ obs.float()) * scale).T
    assert not np.all(np.abs(single.double().numpy() - expected) <= 2.0**-24 * np.abs(expected) + 1e-13 * terms)


@pytest.mark.parametrize("packet", _PACKETS)
def test_decode_in_place_and_nan_stays_in_its_column(packet: torch.dtype) -> None:
    c, width = 8, 700
    decoder, d, w = _decoder(c, seed=3, packet=packet)
    rows = torch.randn(width, c, generator=torch.Generator().manual_seed(4))
    obs = _observations(c, width, ld=width, offset=0, packet=packet, seed=5).clone()
    obs[2, 123] = float("nan")
    rows_in = rows.double().numpy()
    expected = _reference(d, w, rows_in, obs.double().numpy(), 1.0)
    decoder.decode(rows, obs, 1.0, rows)  # out is the input: each column read before it is written
    assert torch.isnan(rows[123]).all() and torch.isfinite(rows[torch.arange(width) != 123]).all()
    keep = np.arange(width) != 123
    # Within float32's rounding of the terms, which cancel: the bound of the test above for
    # 16-bit packets (float32 packets are decoded in float64, well inside it).
    terms = (np.abs(d) @ np.abs(rows_in).T + np.abs(w) @ np.abs(np.nan_to_num(obs.double().numpy()))).T
    error = np.abs(rows.double().numpy() - expected)
    assert np.all(error[keep] <= 2.0**-24 * np.abs(expected[keep]) + 2.0**-22 * 2 * c * terms[keep])


def test_empty_piece_and_refused_arguments() -> None:
    decoder, _, _ = _decoder(4, seed=6)
    out = torch.empty(0, 4)
    decoder.decode(torch.empty(0, 4), torch.empty(4, 0), 1.0, out)  # nothing to do, no error
    wide = torch.empty(4, 10)
    with pytest.raises(ValueError, match=r"ld=3"):  # slots closer than the piece is wide
        decoder.decode(torch.empty(10, 4), wide.as_strided((4, 10), (3, 1)), 1.0, torch.empty(10, 4))
    with pytest.raises(ValueError, match=r"observations.*float16"):  # not the packets it was built for
        decoder.decode(torch.empty(10, 4), wide.half(), 1.0, torch.empty(10, 4))


def test_only_float32_data_on_the_cpu_with_a_packet_it_reads() -> None:
    eye = torch.eye(4, dtype=torch.float64)
    cpu = torch.device("cpu")
    assert native.fused_decoder(eye, eye, torch.float64, torch.float64, cpu) is None
    assert native.fused_decoder(eye, eye, torch.float32, torch.float64, cpu) is None
    assert native.fused_decoder(eye, eye, torch.float32, torch.float32, torch.device("meta")) is None
    wide = torch.eye(33, dtype=torch.float64)  # wider than the kernel is compiled for
    assert native.fused_decoder(wide, wide, torch.float32, torch.float32, cpu) is None


def test_switched_off_by_the_environment(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CERAR_NATIVE", "0")
    eye = torch.eye(4, dtype=torch.float64)
    assert native.fused_decoder(eye, eye, torch.float32, torch.float32, torch.device("cpu")) is None
    assert native.status() == "off: CERAR_NATIVE=0"
    assert not fresh.exists()  # nothing was built


def test_a_compiler_that_fails_leaves_the_torch_ops(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(fresh.parent / "no-such-compiler"))
    eye = torch.eye(4, dtype=torch.float64)
    assert native.fused_decoder(eye, eye, torch.float32, torch.float32, torch.device("cpu")) is None
    assert native.status().startswith("off: build failed") and "no-such-compiler" in native.status()


def test_the_build_is_cached_and_leaves_no_temporary_files(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _decoder(4, seed=7)  # builds into the fresh cache

    def listing() -> list[Path]:  # beside the library, only its build lock (a dot file)
        return sorted(p for p in fresh.iterdir() if not (p.name.startswith(".") and p.name.endswith(".lock")))

    built = listing()
    assert len(built) == 1 and built[0].suffix == ".so", sorted(fresh.iterdir())
    assert native.status() == f"on: {built[0]}"
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_status", None)  # a new process on the same machine
    monkeypatch.setattr(native, "_library", None)
    _decoder(4, seed=7)
    assert listing() == built and built[0].stat().st_mtime_ns == stamp  # reused, not rebuilt


@pytest.mark.parametrize("c", [8, 16, 24])
def test_encode_matches_the_float64_reference(c: int) -> None:
    _decoder(8, seed=0)  # skips where there is no compiler
    g = torch.Generator().manual_seed(c)
    rounds, width = c + 2, 1003  # blocks of 16 columns, one of 8, then the last 3 one by one
    rows = torch.randn(rounds, c, generator=g, dtype=torch.float64) * 100
    encoder = native.fused_encoder(rows, torch.float32, torch.device("cpu"))
    if encoder is None:
        pytest.skip(f"this CPU's build has no vectorised encode: {native.status()}")
    piece = torch.randn(width, c, generator=g)
    out = torch.full((rounds, width + 13), float("nan"))  # rows 13 values apart from their ends
    encoder.encode(piece, out[:, :width])
    expected = rows.float().double().numpy() @ piece.double().numpy().T  # float32 rows, as torch's product
    magnitude = np.abs(rows.float().double().numpy()) @ np.abs(piece.double().numpy()).T
    assert np.all(np.abs(out[:, :width].double().numpy() - expected) <= 2.0**-23 * c * magnitude)
    assert torch.isnan(out[:, width:]).all()  # nothing written past a row's end


def test_encode_is_declined_where_it_is_not_written_for() -> None:
    _decoder(8, seed=0)
    cpu = torch.device("cpu")
    for c in (4, 5, 12, 40):  # not a multiple of 8, or wider than the kernel's registers
        assert native.fused_encoder(torch.ones(c + 2, c, dtype=torch.float64), torch.float32, cpu) is None
    assert native.fused_encoder(torch.ones(10, 8, dtype=torch.float64), torch.float64, cpu) is None
    assert native.fused_encoder(torch.ones(10, 8, dtype=torch.float64), torch.float32, torch.device("meta")) is None


def test_a_cache_folder_that_cannot_be_written_builds_in_the_temp_folder(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = fresh.parent / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("CERAR_CACHE_DIR", str(blocker / "cache"))  # a folder under a file
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(fresh.parent / "tmp"))
    _decoder(4, seed=8)
    assert native.status().startswith(f"on: {fresh.parent / 'tmp'}"), native.status()


def _build_counting(compiler: str, source: bytes, log: str) -> None:
    compile_once = native._compile

    def counted(*args: Path | str | bytes) -> Path:
        with open(log, "a") as out:
            out.write("built\n")
        return compile_once(*args)  # type: ignore[arg-type]

    native._compile = counted  # type: ignore[assignment]
    native._build(compiler, source)


def test_ranks_starting_at_once_build_once(fresh: Path, tmp_path: Path) -> None:
    """Processes of one machine that find no library build it once, the others waiting for it."""
    compiler = native._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    source = resources.files("cerar.comm").joinpath("csrc", "coding.c").read_bytes()
    log = tmp_path / "builds.txt"
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_build_counting, args=(compiler, source, str(log))) for _ in range(3)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0
    assert log.read_text() == "built\n"
    assert [p.suffix for p in fresh.iterdir() if not p.name.endswith(".lock")] == [".so"]
