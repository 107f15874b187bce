"""Builds the attnd package: compiles the API's descriptor from the repository's proto/ (the one
source of truth for the C++ server and both clients) into the built package. Everything else is
declared in pyproject.toml."""

import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
PROTO = "attnd/v1/attention.proto"
# In the repository: its proto/; in an sdist: the copy the sdist command put beside setup.py.
PROTO_ROOT = HERE / "proto" if (HERE / "proto" / PROTO).exists() else HERE.parent.parent / "proto"


def compile_descriptor(out_dir: Path) -> None:
    from grpc_tools import protoc  # a build requirement (pyproject.toml)

    source = PROTO_ROOT / PROTO
    if not source.exists():
        raise RuntimeError(f"{source} not found: build attnd from the attnd repository "
                           "(pip install ./client/python) or from its sdist")
    out_dir.mkdir(parents=True, exist_ok=True)
    rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", "--include_imports",
                      f"--descriptor_set_out={out_dir / 'attention.binpb'}", str(source)])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {source} ({rc})")
    shutil.copy(source, out_dir / "attention.proto")


class BuildPy(build_py):
    def run(self):
        super().run()
        compile_descriptor(Path(self.build_lib) / "attnd" / "v1")


class Sdist(sdist):
    """The sdist carries the proto (it lives outside client/python in the repository)."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        dst = Path(base_dir) / "proto" / PROTO
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(PROTO_ROOT / PROTO, dst)


os.chdir(HERE)
setup(cmdclass={"build_py": BuildPy, "sdist": Sdist})
