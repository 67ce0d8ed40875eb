"""The TCP probe of an emulated link's achieved rate (:func:`measure_link_rate`): one plain stream
from a rank's namespace to another node's, timed by the receiver (:mod:`cerar.harness.netem`
builds the links).
"""

from __future__ import annotations

import subprocess
import sys

from cerar.harness.netem import NetemUnavailable, Network

__all__ = ["PROBE_PORT", "measure_link_rate"]

PROBE_PORT = 5201

_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
s.settimeout(float(sys.argv[3])); c, _ = s.accept(); c.settimeout(float(sys.argv[3]))
n = 0; first = last = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    now = time.perf_counter()
    if first is None: first = now
    else: n += len(b)
    last = now
print(n, (last - first) if first is not None else 0.0, flush=True)
"""

_SOURCE = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
buf = b"\\0" * (1 << 18); end = time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end: s.sendall(buf)
s.close()
"""


def measure_link_rate(net: Network, seconds: float = 0.5, src: int = 0, dst: int = 1) -> float:
    """Achieved TCP payload rate (bytes/s) from rank ``src`` to rank ``dst``'s namespace.

    One plain TCP stream for ``seconds``; the receiver times from its first to its last chunk,
    so connection setup is excluded. Payload only: headers (about 3%) are not counted.
    """
    if len(net.ranks) < 2:
        raise ValueError(f"Argument 'net' must have at least 2 ranks to probe, not {len(net.ranks)}.")
    if net.ranks[src].namespace == net.ranks[dst].namespace:
        raise ValueError(f"Argument 'dst' must be a rank on another node than rank {src}, not {dst}.")
    limit = str(seconds + 20.0)
    sink = subprocess.Popen(
        [*net.exec_prefix(dst), sys.executable, "-c", _SINK, net.ranks[dst].address, str(PROBE_PORT), limit],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert sink.stdout is not None
        if sink.stdout.readline().strip() != "ready":
            raise NetemUnavailable(f"link probe sink failed: {sink.stderr.read() if sink.stderr else ''}")
        source = subprocess.run(
            [
                *net.exec_prefix(src),
                sys.executable,
                "-c",
                _SOURCE,
                net.ranks[dst].address,
                str(PROBE_PORT),
                str(seconds),
                limit,
            ],
            capture_output=True,
            text=True,
            timeout=seconds + 30.0,
            check=False,
        )
        if source.returncode != 0:
            raise NetemUnavailable(f"link probe source failed: {source.stderr.strip()}")
        out, err = sink.communicate(timeout=30.0)
        fields = out.split()
        if sink.returncode != 0 or len(fields) != 2 or float(fields[1]) <= 0:
            raise NetemUnavailable(f"link probe sink failed: {err.strip() or out.strip()}")
        return int(fields[0]) / float(fields[1])
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
