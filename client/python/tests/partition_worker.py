"""A stale worker for test_partition.py, run inside the cut-off primary's network namespace
(``ip netns exec``): decode steps of a sequence at one attnd, naming the generation it knows, one
after another until one is refused (or SECONDS pass). Prints a line per step: ``<status code
name> <when its last layer was sent> <when its reply came> <its commit's protection, or ->``
(times: time.monotonic(), the system's monotonic clock, which the test reads too) and exits 0
whatever the steps' statuses. It prints ``ready`` once connected and waits for a line on stdin
before its first step: its start-up (Python, numpy, a channel) is not taken out of the lease.

    partition_worker.py TARGET SEQUENCE GENERATION SEED SECONDS
"""

from __future__ import annotations

import os
import sys
import time

# As conftest.py: the checkout's client, unless the tests run against the installed package.
if os.environ.get("ATTND_TEST_INSTALLED") != "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from attnd import AttndClient, AttndError, LayerInputs  # noqa: E402

from attnd_testlib import bf16_layers  # noqa: E402


def main() -> None:
    target, sid, generation, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    seconds = float(sys.argv[5])
    with AttndClient(target, timeout=10.0) as c:
        spec = c.info().model
        rng = np.random.default_rng(seed)
        print("ready", flush=True)
        sys.stdin.readline()  # the test cuts the network, then says go
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            x = bf16_layers(spec, 1, rng)
            sent = time.monotonic()
            try:
                step = c.begin_step([(sid, 1)], generations=[generation])
                for i, xi in enumerate(x[:-1]):
                    c.attend_layer(step.step_id, LayerInputs(i, **xi))
                sent = time.monotonic()
                last = c.attend_layer_details(step.step_id, LayerInputs(len(x) - 1, **x[-1]))
                code, protection = "OK", ",".join(last.protection) or "-"
            except AttndError as e:
                code, protection = e.code.name, "-"
            print(code, f"{sent:.4f}", f"{time.monotonic():.4f}", protection, flush=True)
            if code != "OK":
                break


if __name__ == "__main__":
    main()
