"""Makes the checkout's client/python importable, and its compiled API descriptor present, before
the tests import attnd — unless ATTND_TEST_INSTALLED=1: then the tests run against the attnd
package installed in this interpreter (scripts/test_python_package.sh)."""

import os
import subprocess
import sys

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.environ.get("ATTND_TEST_INSTALLED") != "1":
    if PYTHON_DIR not in sys.path:
        sys.path.insert(0, PYTHON_DIR)
    # Idempotent and quiet: recompiles attnd/v1/attention.binpb only when missing or stale.
    subprocess.run([os.path.join(PYTHON_DIR, "generate_stubs.sh")], check=True)
