"""CERAR's CPU coding as compiled C functions, built on first use and loaded with ctypes.

Both halves of the coding are memory-bound. The decode of a piece, ``out = scale (D X + W R)``
accumulated in float64: the torch ops of :meth:`cerar.comm.algorithms.cerar.decode.FoldedDecode.fold` widen
every observation into a float64 scratch and stream a float64 accumulator three times, several
times the bytes the decode must move. The encode, every round's increment ``R_t X``: torch's
``(B, c) x (c, w)`` products read the input once per batch of ``B`` rounds. ``csrc/coding.c``
reads the input once for all rounds' increments, and the input and the observations once for
the decode. It needs no torch headers, so a plain C compiler builds it, in a few seconds (one
instance per code width); it is called through ctypes, which releases the GIL for the call, so the training threads keep
running while a piece is coded.

Built once per machine and source into cerar's private cache folder (:mod:`cerar._cache`:
``$CERAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/cerar`` or ``~/.cache/cerar``, used only while no
other user can write to it; the file name hashes the source, the compiler and the CPU's flags,
since it is built for the CPU it runs on). Nothing is loaded that this process cannot vouch for:
the build runs in a fresh private folder, the library is stored with its SHA-256 beside it, and
a cached library is loaded only if its bytes match that digest, from those very bytes (an
anonymous memory file on Linux, so the file cannot be swapped between the check and the load),
and only if it reports this module's version. A library that fails any check (truncated, empty,
another version's, planted) is rebuilt once; where the cache folder is refused, the library is
built in a fresh private folder for this process. Where there is no compiler, the build fails,
or ``CERAR_NATIVE=0`` is set, :func:`fused_decoder` and :func:`fused_encoder` return None and
the torch ops run instead; :func:`status` says which and why. ``CERAR_NATIVE`` is read whenever
a layout's run is built and at every call (:func:`enabled`), so setting it in a running process
takes effect at the next call. ``CC`` may hold a compiler with arguments (``CC="gcc -O2"``),
split as a shell splits words. The encode is vectorised by hand (AVX2) for codes of 8, 16, 24 or
32 components, the decode compiled for up to 32; elsewhere they return None.

The same library holds the block-quantized ring's coding (:func:`quant_kernels`): the block
quantization of :mod:`cerar.comm.algorithms.ring.quantize`'s torch ops, bit for bit (divisions, no
contraction into fused multiply-adds), for float32 on the CPU, int8, float8 e4m3fn and packed
int4 wires, float32, float16 and bfloat16 scales: the quantize of a packet, its dequantize, and a
reduce-scatter hop's dequantize-add-requantize in one pass over memory.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import threading
from importlib import resources
from pathlib import Path

import torch

from cerar._cache import PrivateFolder, cache_dir
from cerar.comm.runtime.dtypes import DTYPES

__all__ = [
    "KERNELS", "PACKET_KINDS", "QUANT_SCALES", "QUANT_WIRES", "FusedDecoder", "FusedEncoder", "QuantKernels",
    "enabled", "fused_decoder", "fused_encoder", "quant_kernels", "status", "warm",
]  # fmt: skip

_SOURCE = "coding.c"
_VERSION = 4  # cerar_native_version() of the source this module speaks to
_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno")
_BUILD_TIMEOUT_S = 120

#: Packet dtypes the kernel reads, by the code it takes (coding.c's ``PACKET_F32``, ``_F16``, ``_BF16``).
PACKET_KINDS: dict[torch.dtype, int] = {DTYPES["fp32"]: 0, DTYPES["fp16"]: 1, DTYPES["bf16"]: 2}
#: The block-quantization kernels' wires, by the codes they take: by the codes' torch dtype or by
#: the wire's name (int4 has no torch dtype in every supported torch: its codes travel packed).
QUANT_WIRES: dict[torch.dtype | str, int] = {DTYPES["int8"]: 0, DTYPES["fp8"]: 1, "int8": 0, "fp8": 1, "int4": 2}
#: The kernels' scale types, by the codes they take.
QUANT_SCALES: dict[str, int] = {"fp32": 0, "fp16": 1, "bf16": 2}
#: What the library computes, as :func:`status` names it.
KERNELS = "kernels: CERAR's encode and decode, the block-quantized ring's quantize and dequantize-add-requantize"

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_status: str | None = None  # None: not tried yet


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` builds for them): part of the build's name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def enabled() -> bool:
    """Whether the compiled coding may be used: ``CERAR_NATIVE`` is not ``0``. Read at every call
    (a layout's run is kept per value), so that a process can compare both paths."""
    return os.environ.get("CERAR_NATIVE", "1") != "0"


def _compiler() -> list[str] | None:
    """The compiler's command: ``CC`` split as a shell splits it (``gcc -O2``), else cc, gcc or clang."""
    configured = os.environ.get("CC", "").strip()
    if configured:
        return shlex.split(configured)
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return [found] if found else None


def _library_name(compiler: list[str], source: bytes) -> str:
    """The library's file name: a hash of everything the build depends on."""
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    parts = [version, " ".join(compiler), " ".join(_FLAGS), _cpu_flags(), platform.machine()]
    key = hashlib.sha256(b"\0".join([source, *(part.encode() for part in parts)])).hexdigest()[:16]
    return f"coding-{key}.so"


def _build(compiler: list[str], source: bytes) -> tuple[ctypes.CDLL, str]:
    """The loaded library and where it is kept: the cached one if it passes every check, else
    built again (once) and stored; in the cache folder if it is private, else in a fresh private
    folder for this process only (the text says why)."""
    name = _library_name(compiler, source)
    try:
        folder = PrivateFolder.open(cache_dir())
        where = str(folder.path / name)
    except OSError as exc:  # UnsafeFolderError, or it cannot be created: never a shared path
        folder, where = PrivateFolder.fresh(), f"built for this process only (cache folder not used: {exc})"
    with folder, folder.locked(f".{name}.lock"):  # one build per machine; the others wait for it
        data = folder.read(name)
        if data is not None and folder.read(f"{name}.sha256") == _digest(data):
            try:
                return _load_bytes(data, folder.path / name), where
            except (OSError, RuntimeError, AttributeError):
                pass  # a library of another version, or not one: built again below
        data = _compile(compiler, source)
        folder.write(name, data)
        folder.write(f"{name}.sha256", _digest(data))
        return _load_bytes(data, folder.path / name), where


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).hexdigest().encode()


def _compile(compiler: list[str], source: bytes) -> bytes:
    """The library built from ``source`` in a fresh private folder, as bytes."""
    with PrivateFolder.fresh() as build:
        src, out = build.path / "coding.c", build.path / "coding.so"
        build.write(src.name, source)
        result = subprocess.run(
            [*compiler, *_FLAGS, "-o", str(out), str(src)], capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(compiler)} exited with {result.returncode}: {result.stderr.strip()[-500:]}"
            )
        data = build.read(out.name)
        if not data:
            raise RuntimeError(f"{shlex.join(compiler)} wrote no library")
        return data


def _load_bytes(data: bytes, path: Path) -> ctypes.CDLL:
    """Load the library whose bytes are ``data`` (checked): from an anonymous memory file where
    the platform has one, so that what is loaded is what was checked; else from ``path``, in the
    private folder that held ``data``. Raises RuntimeError for another version's library."""
    library = None
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("cerar-coding")
        try:
            os.write(fd, data)
            library = ctypes.CDLL(f"/proc/self/fd/{fd}")
        except OSError:
            library = None  # a kernel that refuses to map memory files executable: the checked file
        finally:
            os.close(fd)  # the mapping outlives the descriptor
    if library is None:
        library = ctypes.CDLL(str(path))
    version = library.cerar_native_version()
    if version != _VERSION:
        raise RuntimeError(f"{path} is version {version}, not {_VERSION}")
    return library


def _load() -> ctypes.CDLL | None:
    """Build (or find) and load the library once per process; None where it cannot be had."""
    global _library, _status
    if not enabled():
        return None
    with _lock:
        if _status is not None:
            return _library
        try:
            compiler = _compiler()
            if compiler is None:
                _status = "off: no C compiler (cc, gcc or clang) on PATH"
                return None
            source = resources.files("cerar.comm.algorithms").joinpath("csrc", _SOURCE).read_bytes()
            library, where = _build(compiler, source)
            _bind(library)
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError, ValueError) as exc:
            _status = f"off: build failed ({exc})"
            return None
        _library, _status = library, f"on: {where}"
        return library


def _bind(library: ctypes.CDLL) -> None:
    """Declare the library's functions' signatures (ctypes would guess them wrong)."""
    function = library.cerar_fused_decode
    function.restype = ctypes.c_int
    function.argtypes = [
        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_double, ctypes.c_void_p,
    ]  # fmt: skip
    library.cerar_encode.restype = ctypes.c_int
    library.cerar_encode.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_void_p]
    library.cerar_encode_supports.restype = ctypes.c_int
    library.cerar_encode_supports.argtypes = [ctypes.c_int64]
    library.cerar_decode_supports.restype = ctypes.c_int
    library.cerar_decode_supports.argtypes = [ctypes.c_int64]
    library.cerar_quant_supports.restype = ctypes.c_int
    library.cerar_quant_supports.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int64]
    head = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]  # values, block, wire, scale
    library.cerar_quantize.restype = ctypes.c_int
    library.cerar_quantize.argtypes = [*head, ctypes.c_void_p, ctypes.c_void_p]
    library.cerar_dequantize.restype = ctypes.c_int
    library.cerar_dequantize.argtypes = [*head, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]
    library.cerar_dequant_add_requant.restype = ctypes.c_int
    library.cerar_dequant_add_requant.argtypes = [*head, *[ctypes.c_void_p] * 3, ctypes.c_int32]


def warm(device: torch.device, data: torch.dtype) -> None:
    """Build or load the library now if a call on ``device`` with ``data`` will use it: a
    collective calls this before its handshake, so that a machine's first build (seconds) is
    over before the handshake lines the ranks up, not inside the rounds."""
    if device.type == "cpu" and data == torch.float32:
        _load()


def status() -> str:
    """Whether the compiled coding is in use (``"on: <library>; kernels: ..."``, what it computes)
    or why not (``"off: ..."``); builds it if that was not tried yet."""
    _load()
    if not enabled():
        return "off: CERAR_NATIVE=0"
    assert _status is not None
    return f"{_status}; {KERNELS}" if _status.startswith("on") else _status


class FusedDecoder:
    """The compiled decode for one code, scale and packet dtype: ``D`` and ``W 2**r``
    transposed, in the precision the kernel accumulates in (float64 for float32 packets, float32
    for 16-bit ones, whose own rounding dwarfs float32's, as the torch ops do), kept beside the
    ctypes function."""

    __slots__ = ("_dt", "_function", "_kind", "_wt", "components", "packet")

    def __init__(
        self, function: ctypes._CFuncPtr, decode_own: torch.Tensor, decode_obs: torch.Tensor, packet: torch.dtype
    ) -> None:
        self._function = function
        self.components = decode_own.shape[0]
        self.packet, self._kind = packet, PACKET_KINDS[packet]
        accumulator = torch.float64 if packet == torch.float32 else torch.float32
        self._dt = decode_own.to(accumulator).t().contiguous()  # dt[j, k] = D[k, j]
        self._wt = decode_obs.to(accumulator).t().contiguous()  # wt[s, k] = W[k, s]

    def decode(self, rows: torch.Tensor, observations: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """``out = scale (D rows^T + W observations)^T``: ``rows`` the piece's ``(w, c)`` float32
        values (may be ``out`` itself), ``observations`` its ``(c, w)`` slots in the packet
        dtype (unit stride along a slot, any stride between slots), ``out`` ``(w, c)`` float32,
        contiguous."""
        w = rows.shape[0]
        if observations.dtype != self.packet:
            raise ValueError(f"Argument 'observations' must be {self.packet}, not {observations.dtype}.")
        code = self._function(
            w, self.components, rows.data_ptr(), observations.data_ptr(), observations.stride(0),
            self._kind, self._dt.data_ptr(), self._wt.data_ptr(), scale, out.data_ptr(),
        )  # fmt: skip
        if code != 0:
            raise ValueError(f"cerar's fused decode refused w={w}, c={self.components}, ld={observations.stride(0)}.")


def fused_decoder(
    decode_own: torch.Tensor, decode_obs: torch.Tensor, data: torch.dtype, packet: torch.dtype, device: torch.device
) -> FusedDecoder | None:
    """A :class:`FusedDecoder` for these float64 decode matrices (``D`` and ``W 2**r``, ``c x c``),
    or None where the torch ops must run: not a CPU tensor, data other than float32, a packet
    dtype the kernel does not read, a code wider than it is compiled for, or no compiled
    library (:func:`status`)."""
    if device.type != "cpu" or data != torch.float32 or packet not in PACKET_KINDS:
        return None
    library = _load()
    if library is None or not library.cerar_decode_supports(decode_own.shape[0]):
        return None
    return FusedDecoder(library.cerar_fused_decode, decode_own, decode_obs, packet)


class FusedEncoder:
    """The compiled encode for one code and scale: the ``(L, c)`` increment rows ``R / 2**r`` in
    float32 (what torch's products use), kept beside the ctypes function."""

    __slots__ = ("_function", "_rows", "components", "rounds")

    def __init__(self, function: ctypes._CFuncPtr, rows: torch.Tensor) -> None:
        self._function = function
        self.rounds, self.components = rows.shape
        self._rows = rows.to(torch.float32).contiguous()

    def encode(self, piece: torch.Tensor, out: torch.Tensor) -> None:
        """``out = rows piece^T``: ``piece`` the ``(w, c)`` float32 values (contiguous), ``out``
        the ``(L, w)`` increments, unit stride along a row."""
        w = piece.shape[0]
        code = self._function(
            w, self.components, self.rounds, piece.data_ptr(), self._rows.data_ptr(), out.stride(0), out.data_ptr()
        )
        if code != 0:
            raise ValueError(f"cerar's encode refused w={w}, c={self.components}, ld={out.stride(0)}.")


def fused_encoder(rows: torch.Tensor, data: torch.dtype, device: torch.device) -> FusedEncoder | None:
    """A :class:`FusedEncoder` for the ``(L, c)`` increment rows (already divided by ``2**r``), or
    None where torch's products must run: not a CPU tensor, data other than float32, a number of
    components the kernel is not written for, or no compiled library (:func:`status`)."""
    if device.type != "cpu" or data != torch.float32:
        return None
    library = _load()
    if library is None or not library.cerar_encode_supports(rows.shape[1]):
        return None
    return FusedEncoder(library.cerar_encode, rows)


class QuantKernels:
    """The compiled block quantization for one wire (int8, float8 e4m3fn or int4), scale type and block size
    (:mod:`cerar.comm.algorithms.ring.quantize`'s torch ops, bit for bit). Tensors: float32 values,
    contiguous; packets contiguous uint8 views of ``packet_bytes(m)`` bytes (any alignment)."""

    __slots__ = ("_dequant_add_requant", "_dequantize", "_head", "_quantize", "block")

    def __init__(self, library: ctypes.CDLL, wire: int, scale: int, block: int) -> None:
        self._quantize, self._dequantize = library.cerar_quantize, library.cerar_dequantize
        self._dequant_add_requant = library.cerar_dequant_add_requant
        self._head, self.block = (block, wire, scale), block

    def quantize(self, x: torch.Tensor, packet: torch.Tensor) -> None:
        """``packet`` = the blocks of ``x`` quantized."""
        self._check(self._quantize(x.numel(), *self._head, x.data_ptr(), packet.data_ptr()), "quantize")

    def dequantize(self, packet: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
        """``out`` = ``packet``'s values, or ``out +=`` them (each product rounded, then added)."""
        code = self._dequantize(out.numel(), *self._head, packet.data_ptr(), out.data_ptr(), int(accumulate))
        self._check(code, "dequantize")

    def dequant_add_requant(self, own: torch.Tensor, arrived: torch.Tensor, out: torch.Tensor, keep: bool) -> None:
        """``own += arrived``'s values; ``out`` = ``own`` quantized; with ``keep``, ``own`` = ``out``'s values."""
        code = self._dequant_add_requant(
            own.numel(), *self._head, own.data_ptr(), arrived.data_ptr(), out.data_ptr(), int(keep)
        )
        self._check(code, "dequantize-add-requantize")

    def _check(self, code: int, name: str) -> None:
        if code != 0:
            raise ValueError(f"cerar's compiled {name} refused block={self.block}, wire/scale {self._head[1:]}.")


def quant_kernels(
    wire: torch.dtype | str, scale: str, block: int, data: torch.dtype, device: torch.device
) -> QuantKernels | None:
    """The compiled block quantization (:class:`QuantKernels`) of ``wire`` (the codes' torch
    dtype, or the wire's name: ``"int8"``, ``"fp8"``, ``"int4"``), or None where the torch ops must
    run: not a CPU tensor, data other than float32, a wire, scale type or block size the kernels
    do not take (int4 blocks must be even; the 3- and 2-bit wires ``"int3"``, ``"int2"`` have no
    kernels, :data:`QUANT_WIRES` does not list them), or no compiled library (:func:`status`)."""
    if device.type != "cpu" or data != torch.float32 or wire not in QUANT_WIRES or scale not in QUANT_SCALES:
        return None
    library = _load()
    if library is None or not library.cerar_quant_supports(QUANT_WIRES[wire], QUANT_SCALES[scale], block):
        return None
    return QuantKernels(library, QUANT_WIRES[wire], QUANT_SCALES[scale], block)
