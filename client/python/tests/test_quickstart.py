"""The README's numpy quick start, run exactly as written (examples/numpy_quickstart.py, which the
README shows verbatim) against a real attnd. The transformers one runs in test_transformers.py
(it needs torch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from attnd_process import ROOT, start

EXAMPLE = ROOT / "examples" / "numpy_quickstart.py"


def test_the_readme_shows_the_quick_starts_verbatim():
    readme = (ROOT / "README.md").read_text()
    for name in ("numpy_quickstart.py", "tiny_transformers.py"):
        code = (ROOT / "examples" / name).read_text()
        assert f"```python\n{code}```" in readme, f"README.md does not show examples/{name} as is"


def test_the_numpy_quick_start_runs_as_written():
    proc, target, _ = start([], kv_pages=64)
    try:
        env = dict(os.environ, ATTND_TARGET=target,
                   PYTHONPATH=os.pathsep.join([str(ROOT / "client" / "python"),
                                               os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run([sys.executable, str(EXAMPLE)], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == [
            "16 token(s): last layer's output (16, 4, 32), sequence length 16",
            "1 token(s): last layer's output (1, 4, 32), sequence length 17"], r.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
