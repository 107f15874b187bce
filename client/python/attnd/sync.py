"""The sync clients run the package's async cores (the handoff's driver, the stream's wait after
a cancel) with blocking calls that never suspend: one loop for both shells, no event loop."""

from __future__ import annotations


def run_sync(coroutine):
    """Runs a coroutine that never suspends (every await in it is of a blocking call) to its end."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    coroutine.close()
    raise RuntimeError("a synchronous call suspended")
