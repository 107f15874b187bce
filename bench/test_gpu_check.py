"""scripts/gpu-check.sh's own logic, on this CPU machine, with a fake bundle: GoogleTest-like
scripts that fail (parameterised names included), crash before writing their XML or hang, and a
fake compute-sanitizer. Checks the stage budget (a stage starts only when its limit fits), the
capped reruns with sanitised log names, "no XML" named per binary, the sanitizer read as
unavailable when it cannot attach, its errors counted, and the stage table in the report."""

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"

# A GoogleTest stand-in: FAILS lists the failing tests ("Suite.case"); CRASH=NAME dies before
# writing its XML; a run without --gtest_output (a rerun) fails when its filter names a failing
# test.
FAKE_GTEST = textwrap.dedent("""\
    #!/usr/bin/env bash
    xml= filter=
    for a in "$@"; do
      case $a in
        --gtest_output=xml:*) xml=${a#--gtest_output=xml:} ;;
        --gtest_filter=*) filter=${a#--gtest_filter=} ;;
        --gtest_list_tests) echo "Fake."; echo "  Passes"; exit 0 ;;
      esac
    done
    me=$(basename "$0")
    [ "${CRASH:-}" = "$me" ] && kill -SEGV $$
    fails=${FAILS:-}
    if [ -z "$xml" ]; then  # a rerun of one test, or a sanitizer's case
      [[ " $fails " == *" $filter "* ]] && { echo "[  FAILED  ] $filter"; exit 1; }
      echo "[  PASSED  ] 1 test."; exit 0
    fi
    echo "filter=$filter"
    {
      echo '<?xml version="1.0"?><testsuites>'
      echo '<testsuite name="Fake"><testcase name="Passes" status="run" result="completed"/>'
      echo '</testsuite>'
      for t in $fails; do
        echo "<testsuite name=\\"${t%%.*}\\"><testcase name=\\"${t#*.}\\" status=\\"run\\">"
        echo '<failure message="x"/></testcase></testsuite>'
      done
      echo '</testsuites>'
    } > "$xml"
    [ -z "$fails" ]
    """)

# compute-sanitizer: FAKE_SANITIZER_MODE=unsupported says so for every tool; =racecheck-errors
# exits with --error-exitcode's 3 under racecheck; =hang never returns; else the tool passes.
FAKE_SANITIZER = textwrap.dedent("""\
    #!/usr/bin/env bash
    tool=$2
    [ "${FAKE_SANITIZER_MODE:-}" = hang ] && exec sleep 1000
    if [ "${FAKE_SANITIZER_MODE:-}" = unsupported ]; then
      echo "========= Error: Device not supported"; exit 1
    fi
    if [ "${FAKE_SANITIZER_MODE:-}" = racecheck-errors ] && [ "$tool" = racecheck ]; then
      echo "========= ERROR SUMMARY: 2 hazards"; exit 3
    fi
    echo "========= ERROR SUMMARY: 0 errors"
    """)


@pytest.fixture()
def fake(tmp_path):
    bundle, bin_dir = tmp_path / "bundle", tmp_path / "bin"
    (bundle / "lib").mkdir(parents=True)
    bin_dir.mkdir()
    for name in ("cuda_test", "cuda_scale_test", "device_test"):
        (bundle / name).write_text(FAKE_GTEST)
        (bundle / name).chmod(0o755)
    (bundle / "cuda_bench").write_text("#!/bin/sh\necho 'cuda_bench: no CUDA device visible'\n")
    (bundle / "cuda_bench").chmod(0o755)
    (bin_dir / "compute-sanitizer").write_text(FAKE_SANITIZER)
    (bin_dir / "compute-sanitizer").chmod(0o755)
    return tmp_path


def run(fake, budget=420, **env):
    out = fake / "out"
    e = dict(os.environ, BUNDLE=str(fake / "bundle"), OUT=str(out), GPU_CHECK_BUDGET_S=str(budget),
             PATH=f"{fake / 'bin'}:{os.environ['PATH']}", **env)
    e.pop("ATTND_REQUIRE_GPU", None)
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=e,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    stages = [json.loads(x) for x in (out / "stages.jsonl").read_text().splitlines()]
    return r.stdout, {s["stage"]: s for s in stages}, out


def test_failures_are_rerun_alone_capped_and_under_sanitised_names(fake):
    fails = ("Modes/CudaParity.MatchesReferenceAndCpuBackend/token_BF16 Cuda.A Cuda.B Cuda.C "
             "Cuda.D")
    text, stages, out = run(fake, FAILS=fails, GPU_CHECK_RERUNS="2")
    assert stages["GPU tests"]["verdict"] == "failed"
    reruns = [s for s in stages if s.startswith("rerun ")]
    assert reruns == ["rerun Modes/CudaParity.MatchesReferenceAndCpuBackend/token_BF16",
                      "rerun Cuda.A"], reruns
    assert (out / "rerun.Modes_CudaParity.MatchesReferenceAndCpuBackend_token_BF16.log"
            ).read_text().startswith("[  FAILED  ]")
    assert "capped at 2 reruns" in stages["reruns"]["note"]
    assert "2 still failing alone" in stages["reruns"]["note"]
    assert "reruns: 2 run (2 still failing alone; capped at 2 reruns" in text


def test_a_binary_that_dies_before_its_xml_is_named(fake):
    text, stages, _ = run(fake, CRASH="cuda_scale_test")
    s = stages["GPU tests at real dimensions"]
    assert s["verdict"] == "failed" and "no XML (timed out or crashed" in s["note"], s
    assert "no XML at" in text and "cuda_scale_test.xml" in text
    assert stages["GPU tests"]["verdict"] == "passed"


def test_a_hung_command_is_killed_at_its_limit_and_the_rest_still_runs(fake):
    text, stages, _ = run(fake, FAKE_SANITIZER_MODE="hang")  # the probe's limit: 30 s
    s = stages["sanitizer probe"]
    assert s["verdict"] == "timed out" and 30 <= s["seconds"] <= 37, s
    assert stages["kernel benchmark"]["verdict"] == "unavailable"  # later stages ran


def test_a_stage_starts_only_when_its_limit_fits_the_budget(fake):
    text, stages, _ = run(fake, budget=100)
    assert stages["GPU tests"]["verdict"] == "not started"  # 120 s does not fit 100
    assert stages["device interface on cuda:0"]["verdict"] == "passed"  # 45 s does
    assert "GPU tests not started: it may take 120s" in text
    assert "no GPU: nothing measured" in text


def test_a_sanitizer_that_cannot_attach_is_unavailable_not_failed(fake):
    text, stages, _ = run(fake, FAKE_SANITIZER_MODE="unsupported")
    assert stages["sanitizer probe"]["verdict"] == "unavailable"
    assert "Device not supported" in stages["sanitizer probe"]["note"]
    assert not any(s.startswith(("memcheck", "racecheck")) for s in stages)
    assert "compute-sanitizer: unavailable" in text


def test_sanitizer_checks_run_after_a_good_probe_and_their_errors_count(fake):
    text, stages, _ = run(fake, FAKE_SANITIZER_MODE="racecheck-errors")
    assert stages["sanitizer probe"]["verdict"] == "passed"
    assert stages["memcheck, DeepSeek dims"]["verdict"] == "passed"
    assert stages["racecheck, tensor-core step"]["verdict"] == "failed"
    assert "racecheck reported errors" in stages["racecheck, tensor-core step"]["note"]
    assert stages["synccheck, tensor-core step"]["verdict"] == "passed"
    assert "compute-sanitizer: errors or not finished" in text


# cuda_bench that measured one row, and ncu: the profile stage runs each kernel's profile.
FAKE_BENCH = textwrap.dedent("""\
    #!/usr/bin/env bash
    for a in "$@"; do
      case $a in --json=*) echo '{"op": "copy D2D (limit)", "ms": 1.0}' > "${a#--json=}" ;; esac
    done
    echo "fake bench"
    """)
FAKE_NCU = textwrap.dedent("""\
    #!/usr/bin/env bash
    echo "ncu $*"
    echo "    Achieved Occupancy    %    12.5"
    """)


def test_the_profile_runs_where_something_was_measured_and_every_file_is_packed(fake):
    text, stages, out = run(fake)
    assert stages["profile"]["verdict"] == "unavailable"  # the dry run measured nothing
    assert "nothing measured" in stages["profile"]["note"]
    (fake / "bundle" / "cuda_bench").write_text(FAKE_BENCH)
    (fake / "bin" / "ncu").write_text(FAKE_NCU)
    (fake / "bin" / "ncu").chmod(0o755)
    text, stages, out = run(fake)
    assert stages["profile"]["verdict"] == "passed", stages["profile"]
    for k in ("MlaWgmmaKernel", "IndexerStreamKernel", "TopKSliceKernel"):
        log = (out / f"ncu-{k}.txt").read_text()
        assert f"regex:{k}" in log and "Achieved Occupancy" in log
    listed = subprocess.run(["tar", "tzf", str(out / "gpu-check-logs.tgz")], capture_output=True,
                            text=True, check=True).stdout.split()
    assert {"./stages.jsonl", "./table.md", "./ncu-MlaWgmmaKernel.txt"} <= set(listed)


# cuda_bench whose MLA rows make the warp-specialised wgmma form the fastest that matched SIMT
# (the mma one is faster still, but its output did not match).
FAKE_BENCH_MLA = textwrap.dedent("""\
    #!/usr/bin/env bash
    f='{"op": "sparse MLA decode (%s, split-K x4)", "shape": "B=64 H=128 K=2048 ctx=8K",'
    f="$f"' "ms": %s, "rate": 1.0, "unit": "GB/s", "frac": 0.1, "check": "rel L2 %s vs SIMT"}\\n'
    for a in "$@"; do
      case $a in --json=*) printf "$f" pipe 1.4 2.0e-03 mma 0.5 3.0e-01 wgmma 0.9 2.0e-03 \\
                             wgmma-ws 0.7 2.0e-03 > "${a#--json=}" ;; esac
    done
    """)


def test_the_profile_takes_the_fastest_mla_form_that_matched(fake):
    (fake / "bundle" / "cuda_bench").write_text(FAKE_BENCH_MLA)
    (fake / "bin" / "ncu").write_text(FAKE_NCU)
    (fake / "bin" / "ncu").chmod(0o755)
    text, stages, out = run(fake, GPU_CHECK_ONLY="bench,profile")
    assert stages["profile"]["verdict"] == "passed", stages["profile"]
    assert "regex:MlaWgmmaWsKernel" in (out / "ncu-MlaWgmmaWsKernel.txt").read_text()
    assert not (out / "ncu-MlaWgmmaKernel.txt").exists()
    assert not (out / "ncu-MlaMmaKernel.txt").exists()
    table = (out / "table.md").read_text()
    assert "mma 0.500 ms (NOT checked)" in table
    assert "MLA choice: wgmma-ws, 2.00x the default (pipe)" in table


def test_a_kernel_iteration_runs_only_the_groups_it_names(fake):
    (fake / "bundle" / "cuda_bench").write_text(FAKE_BENCH)
    (fake / "bin" / "ncu").write_text(FAKE_NCU)
    (fake / "bin" / "ncu").chmod(0o755)
    text, stages, out = run(fake, GPU_CHECK_ONLY="tests,bench,profile", GPU_CHECK_FILTER="Fake.*")
    assert stages["GPU tests"]["verdict"] == "passed"
    for name in ("cuda_test", "cuda_scale_test"):
        assert "filter=Fake.*" in (out / f"{name}.log").read_text()
    assert "device interface on cuda:0" not in stages  # only unfiltered
    for skipped in ("SIMT kernels, bf16 cases", "sanitizer probe", "PyTorch versions"):
        assert stages[skipped]["verdict"] == "skipped", stages[skipped]
    assert stages["kernel benchmark"]["verdict"] == "passed"
    assert stages["profile"]["verdict"] == "passed"
    table = (out / "table.md").read_text()
    assert "compute-sanitizer: not run" in table and "cuda_test_simt" not in table
