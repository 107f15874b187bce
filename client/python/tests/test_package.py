"""The installed package (run by scripts/test_python_package.sh in a fresh venv where
`pip install ./client/python "tritonclient[grpc]"` put it; in a checkout these check the source
tree the same way): its version is the server's, its API comes from the built descriptor, and it
shares a process with tritonclient whatever protobuf that pins."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import attnd
from attnd.v1 import attention_pb2 as pb
from attnd.v1 import attention_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[3]
INSTALLED = os.environ.get("ATTND_TEST_INSTALLED") == "1"


def test_the_installed_package_is_the_one_imported():
    where = Path(attnd.__file__).resolve()
    if INSTALLED:
        assert REPO / "client" / "python" not in where.parents, where
        assert "site-packages" in str(where), where
    assert (Path(pb.__file__).with_name("attention.binpb")).exists()
    assert (Path(attnd.__file__).with_name("py.typed")).exists(), "PEP 561 marker installed"


def test_versions_agree():
    cmake = re.search(r"project\(attnd VERSION (\S+)", (REPO / "CMakeLists.txt").read_text())
    pyproject = re.search(r'^version = "([^"]+)"', (REPO / "client" / "python" /
                                                     "pyproject.toml").read_text(), re.M)
    assert cmake and pyproject and cmake.group(1) == pyproject.group(1) == attnd.__version__


def test_the_api_matches_the_proto():
    proto = (REPO / "proto" / "attnd" / "v1" / "attention.proto").read_text()
    rpcs = re.findall(r"^\s*rpc (\w+)\(", proto, re.M)
    messages = re.findall(r"^message (\w+) \{", proto, re.M)
    assert sorted(rpcs) == sorted(m.name for m in pb_grpc.SERVICE.methods)
    assert len(messages) >= 30
    stub = pb_grpc.AttentionStub(__import__("grpc").insecure_channel("localhost:1"))
    for rpc in rpcs:
        assert callable(getattr(stub, rpc)), rpc
    for m in messages:
        assert getattr(pb, m).DESCRIPTOR.full_name == f"attnd.v1.{m}"
    # Wire-compatible: a message survives a round trip through bytes.
    t = pb.Tensor(datatype="BF16", shape=[2, 3], data=b"\x01\x02" * 6)
    assert pb.Tensor.FromString(t.SerializeToString()) == t


def test_attnd_shares_a_process_with_tritonclient():
    """Protoc output from a newer grpcio-tools refuses an older protobuf runtime (VersionError):
    the descriptor-built API does not care which protobuf tritonclient pins. Runs where
    tritonclient is installed (always in the package venv)."""
    if not INSTALLED:
        pytest.importorskip("tritonclient.grpc")
    code = ("import tritonclient.grpc, attnd, google.protobuf as g; "
            "from attnd.v1 import attention_pb2 as pb; "
            "assert pb.ServerInfoRequest().SerializeToString() == b''; "
            "assert pb.Tensor.FromString(pb.Tensor(datatype='BF16').SerializeToString())"
            ".datatype == 'BF16'; print(g.__version__)")
    env = dict(os.environ)
    if not INSTALLED:
        env["PYTHONPATH"] = str(REPO / "client" / "python")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().split(".")[0].isdigit()
