"""Makes client/python importable and its generated stubs present before the tests import attnd."""

import os
import subprocess
import sys

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)

# Idempotent and quiet: regenerates attnd/v1/attention_pb2*.py only when missing or stale.
subprocess.run([os.path.join(PYTHON_DIR, "generate_stubs.sh")], check=True)
