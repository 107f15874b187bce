"""A stale worker for test_partition.py, run inside the cut-off primary's network namespace
(``ip netns exec``): one decode step of a sequence at one attnd, naming the generation it knows.
Prints ``<status code name> <seconds> <its commit's protection, or ->`` and exits 0 whatever
the step's status."""

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
    with AttndClient(target, timeout=10.0) as c:
        x = bf16_layers(c.info().model, 1, np.random.default_rng(seed))
        started = time.monotonic()
        try:
            step = c.begin_step([(sid, 1)], generations=[generation])
            for i, xi in enumerate(x[:-1]):
                c.attend_layer(step.step_id, LayerInputs(i, **xi))
            last = c.attend_layer_details(step.step_id, LayerInputs(len(x) - 1, **x[-1]))
            code, protection = "OK", ",".join(last.protection) or "-"
        except AttndError as e:
            code, protection = e.code.name, "-"
        print(code, round(time.monotonic() - started, 3), protection, flush=True)


if __name__ == "__main__":
    main()
