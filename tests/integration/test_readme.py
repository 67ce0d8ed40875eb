"""The README's usage block runs as written, on 4 local Gloo ranks under cerar's launcher."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _usage_block() -> str:
    text = README.read_text()
    section = text[text.index("## Using it") :]
    match = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert match is not None, "README's 'Using it' section has no python block"
    return match.group(1)


@pytest.mark.multirank
def test_readme_usage_block_runs(tmp_path: Path) -> None:
    script = tmp_path / "usage.py"
    script.write_text(_usage_block())
    launcher = [sys.executable, "-m", "cerar.harness.launch", "-N", "4", "--timeout", "240", "--"]
    done = subprocess.run(
        [*launcher, sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    # Each rank prints its statistics: bytes sent > 0, and encode/decode times.
    printed = [line.split("] ", 1)[1] for line in done.stdout.splitlines() if line.startswith("[")]
    assert len(printed) == 4, done.stdout
    for line in printed:
        bytes_sent, encode_s, decode_s = line.split()
        assert int(bytes_sent) > 0 and float(encode_s) >= 0 and float(decode_s) >= 0
