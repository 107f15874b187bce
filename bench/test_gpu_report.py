"""gpu_report.py counts GoogleTest results per test case (skips are not passes) and says
"no GPU: nothing measured" when the benchmark wrote no rows."""

import json
import subprocess
import sys
from pathlib import Path

REPORT = Path(__file__).with_name("gpu_report.py")

# As GoogleTest 1.12 writes it: the root carries tests/failures/disabled/errors, no skip count.
XML = """<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="4" failures="1" disabled="0" errors="0" time="0.1" name="AllTests">
  <testsuite name="Cuda" tests="4" failures="1" disabled="0" skipped="0" errors="0" time="0.1">
    <testcase name="Runs" status="run" result="completed" time="0.01" classname="Cuda" />
    <testcase name="Skips" status="run" result="skipped" time="0" classname="Cuda">
      <skipped message="no CUDA device visible: GPU test skipped" />
    </testcase>
    <testcase name="AlsoSkips" status="run" result="skipped" time="0" classname="Cuda" />
    <testcase name="Fails" status="run" result="completed" time="0" classname="Cuda">
      <failure message="expected" type="" />
    </testcase>
  </testsuite>
</testsuites>
"""


def report(tmp_path, bench_rows, xml=XML):
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in bench_rows))
    torch = tmp_path / "torch.jsonl"
    torch.write_text("")
    tests = tmp_path / "tests.xml"
    tests.write_text(xml)
    out = subprocess.run([sys.executable, str(REPORT), str(bench), str(torch), str(tests),
                          str(tmp_path / "missing.xml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_skips_are_counted_per_test_case_and_nothing_measured_is_said(tmp_path):
    text = report(tmp_path, [])
    assert "GPU tests: 1 passed, 1 failed, 2 skipped" in text
    assert text.strip().endswith("no GPU: nothing measured")
    assert "| op |" not in text


def test_an_all_skip_run_says_none_ran(tmp_path):
    xml = XML.replace('<testcase name="Runs" status="run" result="completed" time="0.01" '
                      'classname="Cuda" />', "").replace(
        '<failure message="expected" type="" />', '<skipped message="no GPU" />')
    text = report(tmp_path, [])
    assert "none ran" not in text
    text = report(tmp_path, [], xml)
    assert "GPU tests: 0 passed, 0 failed, 3 skipped" in text
    assert "GPU tests: none ran" in text


def test_measured_rows_make_the_table(tmp_path):
    row = {"op": "sparse MLA decode", "shape": "B=64 H=128 K=2048 ctx=8K", "ms": 0.5,
           "rate": 2000.0, "unit": "GB/s", "frac": 0.45}
    text = report(tmp_path, [row])
    assert ("| sparse MLA decode | B=64 H=128 K=2048 ctx=8K | 0.500 ms | 2000.0 GB/s | 45.0% | - "
            "| - |") in text
    assert "nothing measured" not in text


def test_a_kernel_variant_is_compared_with_the_same_pytorch_op_and_shows_its_check(tmp_path):
    rows = [{"op": "indexer (mma) + top-k", "shape": "B=64 ctx=64K K=2048", "ms": 0.5,
             "rate": 2000.0, "unit": "GB/s", "frac": 0.45,
             "check": "0.9990 of the SIMT scores' top-k"},
            {"op": "sparse MLA decode (mma, split-K x4)", "shape": "B=64 H=128 K=2048 ctx=8K",
             "ms": 0.25, "rate": 4000.0, "unit": "GB/s", "frac": 0.9,
             "check": "150.0 TFLOP/s; rel L2 2.0e-03 vs SIMT"}]
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch = tmp_path / "torch.jsonl"
    torch.write_text(json.dumps({"op": "indexer + top-k", "torch_ms": 2.0}) + "\n" +
                     json.dumps({"op": "sparse MLA decode", "shape_ctx": 8192, "torch_ms": 1.0})
                     + "\n")
    out = subprocess.run([sys.executable, str(REPORT), str(bench), str(torch)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "| 4.00x | 0.9990 of the SIMT scores' top-k |" in out.stdout
    assert "| 4.00x | 150.0 TFLOP/s; rel L2 2.0e-03 vs SIMT |" in out.stdout


def mla_row(form, ctx, ms, check):
    return {"op": f"sparse MLA decode ({form}, split-K x4)",
            "shape": f"B=64 H=128 K=2048 ctx={ctx}", "ms": ms, "rate": 1.0, "unit": "GB/s",
            "frac": 0.1, "check": check}


def fastest(tmp_path, rows):
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, str(REPORT), "--fastest-mla", str(bench)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_mla_choice_is_the_fastest_form_that_matched_simt_in_every_context(tmp_path):
    ok, nan = "1.0 TFLOP/s; rel L2 2.0e-03 vs SIMT", "1.0 TFLOP/s; NaN vs SIMT"
    rows = [mla_row("pipe", "8K", 1.0, ok), mla_row("pipe", "64K", 1.0, ok),
            mla_row("wgmma", "8K", 0.6, ok), mla_row("wgmma", "64K", 0.6, ok),
            # faster, but NaN at 64K: not a candidate anywhere
            mla_row("wgmma-ws", "8K", 0.4, ok), mla_row("wgmma-ws", "64K", 0.4, nan),
            # the small batch and the 16-heads row are not forms at batch 64
            dict(mla_row("mma", "8K", 0.1, ok), shape="B=4 H=128 K=2048 ctx=8K"),
            dict(mla_row("mma", "8K", 0.1, ok), op="sparse MLA decode (mma, 16 heads/block)")]
    assert fastest(tmp_path, rows) == "MlaWgmmaKernel"
    text = report(tmp_path, rows)
    assert "ctx=64K: wgmma-ws 0.400 ms (NOT checked), wgmma 0.600 ms, pipe 1.000 ms" in text
    assert ("MLA choice: wgmma, 1.67x the default (pipe) over these contexts: make WgmmaMla() "
            "default to true") in text
    assert "mma 0.100" not in text


def test_no_mla_choice_without_a_checked_form_or_without_rows(tmp_path):
    bad = [mla_row("pipe", "8K", 1.0, "rel L2 5.0e-02 vs SIMT"), mla_row("mma", "8K", 0.5, None)]
    assert fastest(tmp_path, bad) == ""
    assert "MLA choice: no form passed its check in every context: keep the default" in \
        report(tmp_path, bad)
    assert fastest(tmp_path, []) == ""
    topk = {"op": "top-k", "shape": "B=64", "ms": 1.0, "rate": 1.0, "unit": "GB/s", "frac": 0.1}
    assert "MLA choice" not in report(tmp_path, [topk])
    good = [mla_row("pipe", "8K", 1.0, "rel L2 1.0e-03 vs SIMT")]
    assert fastest(tmp_path, good) == "MlaPipeKernel"
    assert "MLA choice: pipe (the default now" in report(tmp_path, good)


def test_flashinfers_mla_is_a_form_the_choice_can_name(tmp_path):
    ok = "1.0 TFLOP/s; rel L2 3.0e-03 vs SIMT"
    rows = [mla_row("pipe", "8K", 1.0, ok), mla_row("pipe", "64K", 1.2, ok),
            mla_row("flashinfer", "8K", 0.1, ok), mla_row("flashinfer", "64K", 0.12, ok)]
    assert fastest(tmp_path, rows) == "BatchMLAPageAttentionHopperKernel"
    assert "MLA choice: flashinfer, 10.00x the default (pipe)" in report(tmp_path, rows)
    # Off by more than the tolerance: never the choice.
    rows[3] = mla_row("flashinfer", "64K", 0.12, "1.0 TFLOP/s; rel L2 4.0e-02 vs SIMT")
    assert fastest(tmp_path, rows) == "MlaPipeKernel"


def test_the_gemm_floor_is_a_form_its_label_has_no_split(tmp_path):
    ok = "1.0 TFLOP/s; rel L2 3.0e-03 vs SIMT"
    gemm = dict(mla_row("gemm", "8K", 0.5, ok), op="sparse MLA decode (gemm)")
    rows = [mla_row("pipe", "8K", 1.0, ok), gemm]
    assert fastest(tmp_path, rows) == "SoftmaxKernel"
    assert "ctx=8K: gemm 0.500 ms, pipe 1.000 ms" in report(tmp_path, rows)


def test_end_to_end_runs_show_the_server_beside_its_kernels(tmp_path):
    attnctl = {"batch": 64, "context": 65536, "heads": 128, "layers": 4,
               "variants": [{"name": "latent fp8 queries", "server_ms_p50": 9.0,
                             "round_trip_ms_p50": 9.0, "transport_ms_p50": 0.0},
                            {"name": "latent bf16", "server_ms_p50": 1.2,
                             "round_trip_ms_p50": 2.0, "transport_ms_p50": 0.8}]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(attnctl))
    out = subprocess.run([sys.executable, str(REPORT), "--e2e-line", "bf16 default", str(path)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout)
    assert line["server_ms"] == 1.2 and line["transport_ms"] == 0.8
    assert line["run"] == "bf16 default"
    rows = [mla_row("pipe", "64K", 0.5, "ok"),
            {"op": "indexer (stream) + top-k", "shape": "B=64 ctx=64K K=2048", "ms": 1.0,
             "rate": 1.0, "unit": "GB/s", "frac": 0.1}]
    e2e = tmp_path / "e2e.jsonl"
    e2e.write_text(json.dumps(line) + "\n" +
                   json.dumps(dict(line, run="bf16 library", context=8192)) + "\n")
    bench = tmp_path / "b.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch = tmp_path / "t.jsonl"
    torch.write_text("")
    text = subprocess.run([sys.executable, str(REPORT), f"--e2e={e2e}", str(bench), str(torch)],
                          capture_output=True, text=True).stdout
    # mean layer of F/S/F/S: the MLA (0.5) + half the indexer and top-k (1.0): 1.0 ms
    want = ("| bf16 default | B=64 H=128 ctx=64K | 1.200 ms | 2.000 ms | 0.800 ms | 1.000 ms | "
            "1.20x |")
    assert want in text
    assert "| bf16 library | B=64 H=128 ctx=8K |" in text and "not measured at this shape" in text
