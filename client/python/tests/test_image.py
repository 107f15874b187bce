"""The container image's package lists against the build (issue 52: deploy/Dockerfile could not
build main once CMake required ZeroMQ and msgpack, and its runtime stage lacked libzmq5): every
library CMake finds for attnd and attnctl has its development package in the Dockerfile's build
stage and in install-deps.sh's run profile, and every shared library the built attnd and attnctl
load has its runtime package in the image's final stage. A new dependency fails here until all
three lists (and the tables below) name it."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from attnd_process import ATTND_BIN, ROOT

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
INSTALL = ROOT / "scripts" / "install-deps.sh"

# find_package(NAME) -> the Debian/Ubuntu packages that provide it (None: not from apt).
DEV_PACKAGES = {
    "absl": ["libabsl-dev"],
    "nlohmann_json": ["nlohmann-json3-dev"],
    "Threads": [],  # libc
    "OpenSSL": ["libssl-dev"],
    "Protobuf": ["libprotobuf-dev", "protobuf-compiler"],
    "gRPC": ["libgrpc++-dev", "protobuf-compiler-grpc"],
    "prometheus-cpp": ["prometheus-cpp-dev"],
    "PkgConfig": ["pkg-config"],
    "cpp-httplib": ["libcpp-httplib-dev"],  # pkg_check_modules
    "glog": ["libgoogle-glog-dev"],
    "cppzmq": ["cppzmq-dev", "libzmq3-dev"],
    "msgpack": ["libmsgpack-cxx-dev"],
    "CUDAToolkit": None,  # the CUDA devel base image
    "FlashInfer": None,  # scripts/fetch-gpu-libs.sh (pinned wheels' headers)
    "Cutlass": None,
}
# A shared library attnd or attnctl loads (its soname, up to the version) -> the Ubuntu 24.04
# package of the image's final stage that holds it ("" = the base image has it).
RUNTIME_PACKAGES = [
    (r"libgrpc\+\+(_reflection)?\.so\.1\.51", "libgrpc++1.51t64"),
    (r"lib(grpc|gpr)\.so\.29", "libgrpc29t64"),
    (r"libabsl_\w+\.so\.20220623", "libabsl20220623t64"),
    (r"libprotobuf\.so\.32", "libprotobuf32t64"),
    (r"libprometheus-cpp-core\.so\.1\.0", "libprometheus-cpp-core1.0"),
    # Debian 12 has cpp-httplib 0.11 (libcpp-httplib.so.0.11), the image's Ubuntu 24.04 0.14.
    (r"libcpp-httplib\.so\.0\.1[14]", "libcpp-httplib0.14t64"),
    (r"libglog\.so\.1", "libgoogle-glog0v6t64"),
    (r"lib(ssl|crypto)\.so\.3", "libssl3t64"),
    (r"libzmq\.so\.5", "libzmq5"),
    (r"libuc[pst]\.so\.0", "libucx0"),  # the data plane (its transports load from the same)
    (r"(libstdc\+\+\.so\.6|libm\.so\.6|libgcc_s\.so\.1|libc\.so\.6|ld-linux-x86-64\.so\.2)", ""),
]


def _stage(name: str) -> str:
    """The text of the Dockerfile's stage `name` ("" for the last, unnamed one)."""
    stages = re.split(r"^FROM ", DOCKERFILE.read_text(), flags=re.M)[1:]
    for s in stages:
        head = s.split("\n", 1)[0]
        if (name and head.endswith(f" AS {name}")) or (not name and " AS " not in head):
            return s
    raise AssertionError(f"no stage {name or '(final)'} in {DOCKERFILE}")


def _apt_packages(text: str) -> set[str]:
    """The packages of every `apt-get install` in `text` (continuation lines joined)."""
    joined = text.replace("\\\n", " ")
    found = set()
    for m in re.finditer(r"apt-get install ([^&\n]*)", joined):
        found |= {w for w in m.group(1).split() if not w.startswith("-")}
    return found


def _run_profile() -> set[str]:
    m = re.search(r"^run_pkgs=\((.*?)^\)", INSTALL.read_text(), re.M | re.S)
    assert m, "install-deps.sh has no run_pkgs list"
    return {w for line in m.group(1).splitlines() for w in line.split("#", 1)[0].split()}


def _product_find_packages() -> set[str]:
    names = set()
    for cm in [ROOT / "CMakeLists.txt", *(ROOT / d / "CMakeLists.txt"
                                          for d in ("client", "cluster", "service", "metrics"))]:
        if cm.exists():
            text = cm.read_text()
            names |= set(re.findall(r"^\s*find_package\(([\w-]+)", text, re.M))
            names |= set(re.findall(
                r"^\s*pkg_check_modules\(\w+(?: REQUIRED| IMPORTED_TARGET)* ([\w-]+)", text, re.M))
    return names


def test_every_library_cmake_finds_is_installed_by_the_image_and_by_run_sh():
    build, run = _apt_packages(_stage("build")), _run_profile()
    found = _product_find_packages()
    assert {"gRPC", "cppzmq", "msgpack", "prometheus-cpp", "cpp-httplib"} <= found, found
    for name in sorted(found):
        assert name in DEV_PACKAGES, f"find_package({name}): add its packages to DEV_PACKAGES, " \
                                     "deploy/Dockerfile and install-deps.sh's run profile"
        for pkg in DEV_PACKAGES[name] or []:
            assert pkg in build, f"find_package({name}): the Dockerfile's build stage lacks {pkg}"
            assert pkg in run, f"find_package({name}): install-deps.sh run lacks {pkg}"
    # Header-only libraries found by include path, not by CMake.
    if any("<CLI/CLI.hpp>" in p.read_text() for p in (ROOT / "client").glob("*.cc")):
        assert "libcli11-dev" in build and "libcli11-dev" in run
    assert "fetch-gpu-libs.sh" in _stage("build"), "the CUDA build needs FlashInfer's headers"


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) not installed")
def test_every_shared_library_attnd_loads_is_in_the_images_final_stage():
    final = _apt_packages(_stage(""))
    needed = set()
    for binary in (ATTND_BIN, ATTND_BIN.parent.parent / "client" / "attnctl"):
        out = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True,
                             check=True).stdout
        needed |= set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out))
    assert any(n.startswith("libzmq") for n in needed), needed  # the parse sees the real list
    for soname in sorted(needed):
        pkg = next((p for pattern, p in RUNTIME_PACKAGES if re.fullmatch(pattern, soname)), None)
        assert pkg is not None, f"{soname}: add its runtime package to RUNTIME_PACKAGES and " \
                                "the Dockerfile's final stage"
        if pkg:
            assert pkg in final, f"{soname}: the image's final stage lacks {pkg}"


def test_the_image_has_a_test_stage_that_runs_the_version_and_the_demo():
    test = _stage("test")
    assert test.startswith("build AS test")
    assert "attnd --version" in test and "attnctl demo" in test and "--model=demo" in test


@pytest.mark.skipif(shutil.which("buildah") is None and shutil.which("podman") is None
                    and shutil.which("docker") is None, reason="no container builder installed")
def test_the_image_builds_where_a_builder_and_its_registry_are_at_hand():
    tool = shutil.which("buildah") or shutil.which("podman") or shutil.which("docker")
    probe = subprocess.run([tool, "pull", "nvidia/cuda:13.0.0-runtime-ubuntu24.04"],
                           capture_output=True, text=True, timeout=600)
    if probe.returncode != 0:
        pytest.skip(f"{tool} cannot pull NVIDIA's base image here: {probe.stderr.strip()[-200:]}")
    r = subprocess.run([tool, "build", "-f", str(DOCKERFILE), "--target", "test", str(ROOT)],
                       capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
