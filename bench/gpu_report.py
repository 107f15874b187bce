"""Joins cuda_bench's JSON lines, the PyTorch timings and the parity test results into one
markdown table (scripts/gpu-check.sh)."""

import json
import sys
import xml.etree.ElementTree as ET


def lines(path):
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.strip()]
    except OSError:
        return []


def main():
    ours, torch_rows = lines(sys.argv[1]), lines(sys.argv[2])
    parity = "parity tests: not run"
    if len(sys.argv) > 3:
        try:
            root = ET.parse(sys.argv[3]).getroot()
            t, f, s = (int(root.get(k, 0)) for k in ("tests", "failures", "skipped"))
            parity = f"parity tests: {t - f - s} passed, {f} failed, {s} skipped"
        except (OSError, ET.ParseError):
            pass

    def torch_ms(row):
        op = row["op"].replace(" (mma)", "")
        if op == "prefill MLA":
            op = "prefill MLA (dense causal)"
        for r in torch_rows:
            if r["op"] == op and ("shape_ctx" not in r or f"ctx={r['shape_ctx'] // 1024}K" in row["shape"]):
                return r["torch_ms"]
        return None

    gemm = next((r for r in torch_rows if r["op"] == "bf16 GEMM (limit)"), None)
    if gemm:
        print(f"bf16 matmul rate (PyTorch, 8192^3): {gemm['tflops']:.1f} TFLOP/s")
        for r in ours:
            if r["unit"] == "TFLOP/s":
                r["frac"] = r["rate"] / gemm["tflops"]
    print(parity)
    print()
    print("| op | shape | time | rate | of limit | speed-up over PyTorch |")
    print("|---|---|---|---|---|---|")
    for r in ours:
        t = torch_ms(r)
        sp = f"{t / r['ms']:.2f}x" if t else "-"
        frac = f"{100 * r['frac']:.1f}%" if r["frac"] >= 0 else "-"
        print(f"| {r['op']} | {r['shape']} | {r['ms']:.3f} ms | {r['rate']:.1f} {r['unit']} | "
              f"{frac} | {sp} |")


if __name__ == "__main__":
    main()
