"""cerar.comm.algorithms.native: the compiled decode against an independent float64 reference (numpy), and
its build: cached, atomic, and off with a reason where it cannot be had."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch

from cerar.comm.algorithms import native

_PACKETS = [torch.float32, torch.float16, torch.bfloat16]


#: The libraries this session's tests compiled, by compiler and source: the compiler is run once
#: for each, and the bytes of that real build are what the later tests' builds return. What these
#: tests check is what cerar does with a build's bytes (the cache, its digests, its locks, the
#: rebuild of a damaged library), which the same bytes exercise as a new compile would.
_BUILT: dict[tuple[tuple[str, ...], bytes], bytes] = {}
_COMPILE = native._compile


def _compile_once(compiler: list[str], source: bytes) -> bytes:
    key = (tuple(compiler), source)
    if key not in _BUILT:
        _BUILT[key] = _COMPILE(compiler, source)
    return _BUILT[key]


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A process that has not tried the build yet, with its own cache folder."""
    monkeypatch.setattr(native, "_compile", _compile_once)
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


def test_the_quantize_kernels_take_int4_in_even_blocks_only() -> None:
    """The library's ABI for the block wires: wire codes 0 (int8), 1 (fp8), 2 (int4, even blocks),
    and the packet size with int4's codes two a byte."""
    library = native._load()
    if library is None:
        pytest.skip(native.status())
    assert library.cerar_native_version() == native._VERSION
    int4 = native.QUANT_WIRES["int4"]
    assert native.QUANT_WIRES[torch.int8] == native.QUANT_WIRES["int8"] == 0
    assert library.cerar_quant_supports(int4, 2, 32) == 1 and library.cerar_quant_supports(int4, 2, 33) == 0
    assert library.cerar_quant_supports(0, 2, 33) == 1 and library.cerar_quant_supports(3, 2, 32) == 0
    packet_bytes = library.cerar_quant_packet_bytes
    packet_bytes.restype = ctypes.c_int64
    packet_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]
    assert packet_bytes(65, 32, int4, 2) == 3 * 2 + 33 and packet_bytes(65, 32, 0, 0) == 3 * 4 + 65
    cpu = torch.device("cpu")
    assert native.quant_kernels("int4", "bf16", 31, torch.float32, cpu) is None
    kernels = native.quant_kernels("int4", "bf16", 32, torch.float32, cpu)
    assert kernels is not None
    with pytest.raises(ValueError, match="block=32"):
        native.QuantKernels(library, int4, 9, 32).quantize(torch.ones(4), torch.empty(8, dtype=torch.uint8))


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

    def listing() -> list[Path]:  # beside the library, its digest and its build lock (a dot file)
        return sorted(p for p in fresh.iterdir() if not (p.name.startswith(".") and p.name.endswith(".lock")))

    built = listing()
    assert [p.name.removeprefix(built[0].name) for p in built] == ["", ".sha256"], sorted(fresh.iterdir())
    assert built[0].suffix == ".so" and native.status() == f"on: {built[0]}; {native.KERNELS}"
    assert fresh.stat().st_mode & 0o777 == 0o700  # created private
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


def test_a_cache_folder_that_cannot_be_written_builds_for_the_process_only(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = fresh.parent / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("CERAR_CACHE_DIR", str(blocker / "cache"))  # a folder under a file
    spare = fresh.parent / "tmp"
    spare.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spare))
    _assert_decodes_right()
    assert native.status().startswith("on: built for this process only (cache folder not used:"), native.status()
    assert list(spare.iterdir()) == []  # its private build folders are gone; nothing predictable was left


def _build_counting(compiler: list[str], source: bytes, log: str) -> None:
    compile_once = native._compile

    def counted(*args: list[str] | bytes) -> bytes:
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
    source = resources.files("cerar.comm.algorithms").joinpath("csrc", "coding.c").read_bytes()
    log = tmp_path / "builds.txt"
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_build_counting, args=(compiler, source, str(log))) for _ in range(3)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0
    assert log.read_text() == "built\n"
    assert sorted(p.suffix for p in fresh.iterdir() if not p.name.endswith(".lock")) == [".sha256", ".so"]


# ---------------------------------------------------------------------------------------------
# Nothing runs that cerar did not build: another user's folder, planted, corrupt and
# other-version libraries, links. A planted library announces itself: its constructor writes a
# marker file, so a test can tell it was never loaded.

_PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) { FILE *f = fopen("%s", "w"); if (f) fclose(f); }
int cerar_native_version(void) { return %d; }
"""


def _compile_c(text: str, where: Path) -> bytes:
    compiler = native._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    src, out = where / "planted.c", where / "planted.so"
    src.write_text(text)
    subprocess.run([*compiler, "-O1", "-fPIC", "-shared", "-o", str(out), str(src)], check=True, timeout=120)
    return out.read_bytes()


def _planted(tmp_path: Path) -> tuple[bytes, Path]:
    """A library whose constructor writes ``marker`` and which says it is this module's version."""
    marker = tmp_path / "planted-code-ran"
    return _compile_c(_PLANTED % (marker, native._VERSION), tmp_path), marker


def _library_name() -> str:
    compiler = native._compiler()
    assert compiler is not None
    source = resources.files("cerar.comm.algorithms").joinpath("csrc", "coding.c").read_bytes()
    return native._library_name(compiler, source)


def _new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_status", None)
    monkeypatch.setattr(native, "_library", None)


def _assert_decodes_right() -> None:
    """The compiled decode is in use and right (the reference test's check, one case)."""
    decoder, d, w = _decoder(8, seed=11)
    rows = torch.randn(300, 8, generator=torch.Generator().manual_seed(12))
    obs = _observations(8, 300, ld=300, offset=0, packet=torch.float32, seed=13)
    out = torch.empty(300, 8)
    decoder.decode(rows, obs, 1.0, out)
    expected = _reference(d, w, rows.double().numpy(), obs.double().numpy(), 1.0)
    terms = (np.abs(d) @ np.abs(rows.double().numpy()).T + np.abs(w) @ np.abs(obs.double().numpy())).T
    assert np.all(np.abs(out.double().numpy() - expected) <= 2.0**-24 * np.abs(expected) + 1e-13 * terms)


def _damaged(kind: str, genuine: bytes, tmp_path: Path) -> bytes:
    if kind == "truncated":
        return genuine[: len(genuine) // 2]
    if kind == "empty":
        return b""
    if kind == "random":
        return np.random.default_rng(0).bytes(len(genuine))
    # Another version's library: the real source, built to say another version.
    source = resources.files("cerar.comm.algorithms").joinpath("csrc", "coding.c").read_text()
    other = source.replace(f"{{ return {native._VERSION}; }}", f"{{ return {native._VERSION + 1}; }}")
    assert other != source
    return _compile_c(other, tmp_path)


# A matching digest beside a damaged library is what this user wrote (the folder is private):
# truncated, it is not a damage to survive (loading it may raise SIGBUS), so it is left out.
@pytest.mark.parametrize(
    ("kind", "with_digest"),
    [(kind, False) for kind in ("truncated", "empty", "random", "other-version")]
    + [(kind, True) for kind in ("empty", "random", "other-version")],
)
def test_a_damaged_library_is_rebuilt_once(
    fresh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, with_digest: bool
) -> None:
    _assert_decodes_right()  # the genuine build, cached
    name = _library_name()
    genuine = (fresh / name).read_bytes()
    damaged = _damaged(kind, genuine, tmp_path)
    (fresh / name).write_bytes(damaged)
    if with_digest:
        (fresh / f"{name}.sha256").write_bytes(native._digest(damaged))
    _new_process(monkeypatch)
    _assert_decodes_right()
    assert native.status() == f"on: {fresh / name}; {native.KERNELS}"
    assert native._digest((fresh / name).read_bytes()) == (fresh / f"{name}.sha256").read_bytes()


def test_a_library_planted_in_the_cache_is_not_loaded(
    fresh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh.mkdir(mode=0o700)
    planted, marker = _planted(tmp_path)
    (fresh / _library_name()).write_bytes(planted)  # under the name cerar would look for, no digest
    _assert_decodes_right()
    assert not marker.exists()
    assert native._digest((fresh / _library_name()).read_bytes()) == (fresh / f"{_library_name()}.sha256").read_bytes()


def _other_user() -> int:
    if os.getuid() != 0:
        pytest.skip("only root can give a folder to another user")
    return 65534  # nobody


@pytest.mark.parametrize("how", ["another user's", "writable by all"])
def test_a_folder_others_can_write_is_not_used(
    fresh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    planted, marker = _planted(tmp_path)
    fresh.mkdir(mode=0o700)
    name = _library_name()
    (fresh / name).write_bytes(planted)
    (fresh / f"{name}.sha256").write_bytes(native._digest(planted))  # a digest that matches, too
    if how == "another user's":
        for path in (fresh, *fresh.iterdir()):
            os.chown(path, _other_user(), _other_user())
    else:
        fresh.chmod(0o777)
    before = sorted(p.name for p in fresh.iterdir())
    _assert_decodes_right()
    assert not marker.exists()
    assert "cache folder not used" in native.status() and str(fresh) in native.status(), native.status()
    assert sorted(p.name for p in fresh.iterdir()) == before  # nothing written there either


def test_the_old_shared_temp_folder_is_never_used(fresh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder planted at the temp folder's predictable name (``cerar-<uid>``, the old fallback)."""
    spare = tmp_path / "tmp"
    shared = spare / f"cerar-{os.getuid()}"
    shared.mkdir(parents=True)
    planted, marker = _planted(tmp_path)
    (shared / _library_name()).write_bytes(planted)
    (shared / f"{_library_name()}.sha256").write_bytes(native._digest(planted))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("CERAR_CACHE_DIR", str(blocker / "cache"))  # the cache folder cannot be made
    monkeypatch.setattr(tempfile, "tempdir", str(spare))
    _assert_decodes_right()
    assert not marker.exists()


def test_links_in_the_cache_are_not_followed(fresh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    planted, marker = _planted(tmp_path)
    outside = tmp_path / "outside.so"
    outside.write_bytes(planted)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    fresh.mkdir(mode=0o700)
    name = _library_name()
    (fresh / name).symlink_to(outside)  # the library's name -> a planted library
    (fresh / f"{name}.sha256").symlink_to(victim)  # the digest's name -> a file the build must not write
    (fresh / "coding.c").symlink_to(victim)  # where a source file would go
    _assert_decodes_right()
    assert not marker.exists() and victim.read_text() == "keep me" and outside.read_bytes() == planted
    assert not (fresh / name).is_symlink() and not (fresh / f"{name}.sha256").is_symlink()  # replaced, not followed


def test_a_cache_folder_that_is_a_link_is_not_used(fresh: Path, tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    fresh.symlink_to(real)
    _assert_decodes_right()
    assert "cache folder not used" in native.status()
    assert list(real.iterdir()) == []


def test_a_compiler_with_arguments(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = native._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("CC", f"{compiler[0]} -O2 -DCERAR_UNUSED='a b'")
    assert native._compiler() == [compiler[0], "-O2", "-DCERAR_UNUSED=a b"]
    _assert_decodes_right()
    assert native.status().startswith("on: "), native.status()


def test_a_compiler_setting_that_does_not_parse(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "gcc 'unclosed")
    eye = torch.eye(4, dtype=torch.float64)
    assert native.fused_decoder(eye, eye, torch.float32, torch.float32, torch.device("cpu")) is None
    assert native.status().startswith("off: build failed") and "quotation" in native.status()


def test_switching_it_off_in_a_running_process_takes_effect_at_the_next_call(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``CERAR_NATIVE=0`` set after a layout has run: that layout's next call runs the torch ops."""
    from cerar.coding import codes
    from cerar.comm.algorithms.cerar.run import CerarRun
    from cerar.comm.algorithms.cerar.scale import PacketScale
    from cerar.comm.runtime.links import Ring

    _decoder(8, seed=0)  # skips where there is no compiler
    ring = Ring(None, 0, 4, 1, 3, (0, 1, 2, 3))
    code, flat = codes.perturbed(4, 8), torch.zeros(8 * 1000)
    scale = PacketScale(ring, code, flat, torch.float32)
    assert CerarRun.for_call(flat, code, ring, scale, torch.float32).decoder is not None
    monkeypatch.setenv("CERAR_NATIVE", "0")
    run = CerarRun.for_call(flat, code, ring, scale, torch.float32)
    assert run.decoder is None and run.encoder is None
    monkeypatch.delenv("CERAR_NATIVE")
    assert CerarRun.for_call(flat, code, ring, scale, torch.float32).decoder is not None
