"""Starting a real attnd for the tests that need one of their own (tiny model, loopback)."""

from __future__ import annotations

import contextlib
import os
import queue
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[3]
ATTND_BIN = Path(os.environ.get("ATTND_BIN", ROOT / "build" / "service" / "attnd"))
STARTUP_TIMEOUT_S = 30.0


_ports = random.SystemRandom()  # not the random module's state, which tests may seed


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port the kernel hands out (bind to
    0) can be taken again by any outgoing connection before the server that was to listen on it
    starts (a cluster test's third replica found its port in use, once, with three pytest
    workers). Falls back to the kernel's choice where that range is too small."""
    low = _ephemeral_low()
    for _ in range(100 if low > 10001 else 0):
        port = _ports.randint(10000, low - 1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump_until_serving(stream, lines: queue.Queue) -> None:
    """Puts the lines of `stream` into `lines` up to the serving line; None at EOF."""
    for line in stream:
        lines.put(line)
        if "serving attnd.v1" in line:
            return
    lines.put(None)


def start(extra: List[str], *, kv_pages: Optional[int] = 256, threads: int = 2,
          port: Optional[int] = None, log: Optional[Path] = None, first: Sequence[str] = (),
          wrap: Sequence[str] = ()) -> Tuple[subprocess.Popen, str, int]:
    """attnd on 127.0.0.1 with `extra` flags (later flags win; kv_pages None: no --kv-pages) on
    ``port`` (default: a free one); returns (process, target, metrics port) once it printed its
    serving line (``first``: flags before the test's own, which override them, e.g. a deployment's
    command line; ``wrap``: a command it runs under, e.g. ``ip netns exec NAME``). Its stdout and
    stderr stay readable from the process, or with ``log`` go to that file (for a server that
    lives long and logs much)."""
    # free_port() closes the port it found: another process can take it before attnd binds it
    # ("Address already in use"), so a start that lost such a race is tried again on fresh ports.
    for attempt in range(3):
        chosen, mport = port or free_port(), free_port()
        pages = [] if kv_pages is None else [f"--kv-pages={kv_pages}"]
        cmd = [*wrap, str(ATTND_BIN), *first, f"--grpc-port={chosen}", "--grpc-address=127.0.0.1",
               "--model=tiny", *pages, f"--threads={threads}", f"--metrics-port={mport}", *extra]
        if log is None:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            # Log lines (a warning) may come before the serving line; EOF: it exited. A server
            # that neither serves nor exits in STARTUP_TIMEOUT_S is killed. The lines are read
            # by a thread that stops at the serving line (the caller may read on from there).
            lines: queue.Queue[Optional[str]] = queue.Queue()
            threading.Thread(target=_pump_until_serving, args=(proc.stdout, lines),
                             daemon=True).start()
            out, deadline = "", time.monotonic() + STARTUP_TIMEOUT_S
            while True:
                try:
                    line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    proc.kill()
                    proc.wait(timeout=30)
                    raise AssertionError(f"attnd did not start in {STARTUP_TIMEOUT_S} s: {cmd}\n"
                                         f"{out}") from None
                if line is None:
                    break
                if "serving attnd.v1" in line:
                    return proc, f"127.0.0.1:{chosen}", mport
                out += line
            proc.wait(timeout=30)
            if "Address already in use" in out and attempt < 2:
                continue
            raise AssertionError(f"attnd exited with {proc.returncode} at startup: {cmd}\n{out}")
        with open(log, "wb") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while "serving attnd.v1" not in tail(log):
            if proc.poll() is not None and "Address already in use" in tail(log) and attempt < 2:
                break
            assert proc.poll() is None, (f"attnd exited with {proc.returncode} at startup: {cmd}\n"
                                         f"{tail(log)}")
            assert time.monotonic() < deadline, (f"attnd did not start in {STARTUP_TIMEOUT_S} s\n"
                                                 f"{tail(log)}")
            time.sleep(0.05)
        else:
            return proc, f"127.0.0.1:{chosen}", mport
    raise AssertionError("unreachable: the last attempt returns or raises")


def tail(path: Path, n: int = 4000) -> str:
    """The last ``n`` characters of a log file ("" if unreadable)."""
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, and a clean exit within 30 s."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


@contextlib.contextmanager
def running(extra: List[str], **kwargs) -> Iterator[Tuple[subprocess.Popen, str, int]]:
    """start(extra, **kwargs) for a block, and stop() (a clean exit) when it ends."""
    proc, target, mport = start(extra, **kwargs)
    try:
        yield proc, target, mport
    finally:
        stop(proc)
