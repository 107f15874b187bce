"""Joins cuda_bench's JSON lines, the PyTorch timings and the GPU test results into one markdown
table (scripts/gpu-check.sh).

  gpu_report.py [--stages=STAGES.jsonl] [--e2e=E2E.jsonl] BENCH.jsonl TORCH.jsonl [TESTS.xml ...]
  gpu_report.py --e2e-line RUN ATTNCTL_BENCH.json   (one line of E2E.jsonl)

With --stages (gpu-check's record of each stage: limit, seconds, verdict, note) the report opens
with the stage table, the sanitizer's verdict and the reruns. A test XML file that is missing or
unreadable is named ("no XML": the binary timed out or crashed before writing it).

After the table, the sparse MLA's kernel forms at batch 64 (pipe, mma, wgmma, wgmma-ws,
flashinfer, gemm) are ranked per context: the fastest whose output is within 1e-2 relative L2 of
the SIMT kernel's, against the form attnd takes by default (pipe), and what to change to make it
the default. With --e2e, the end-to-end runs (attnd on the GPU, attnctl bench): the server's
layer time beside its round trip and beside its kernels' sum where cuda_bench timed that shape.
`gpu_report.py --fastest-mla BENCH.jsonl` prints only the fastest checked form's kernel name
(gpu-check profiles it), or nothing.

Test results are counted per test case (GoogleTest writes no skip count on the root element):
a case is skipped when it has a <skipped> element or result="skipped", failed when it has a
<failure>. With no benchmark rows the report says "no GPU: nothing measured" instead of a table.
"""

import json
import re
import sys
import xml.etree.ElementTree as ET


def lines(path):
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def count_tests(paths, missing=None):
    """(passed, failed, skipped, files read) over every test case of the given XML files; the
    paths that could not be read are appended to `missing`."""
    passed = failed = skipped = read = 0
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            if missing is not None:
                missing.append(path)
            continue
        read += 1
        for case in root.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
            elif case.find("skipped") is not None or case.get("result") == "skipped" or \
                    case.get("status") == "notrun":
                skipped += 1
            else:
                passed += 1
    return passed, failed, skipped, read


# The sparse MLA's forms as cuda_bench labels them, their kernels, and how each becomes the
# default (kernels/cuda/ops/cuda_kernels.h: MlaParams; kernels/cuda/backend/cuda_device.cc).
MLA_FORMS = {
    "pipe": ("MlaPipeKernel", "the default now (MlaParams::pipeline = true, wgmma off)"),
    "mma": ("MlaMmaKernel", "set MlaParams::pipeline's default to false"),
    "wgmma": ("MlaWgmmaKernel", "make WgmmaMla() default to true on compute capability 9.0"),
    "wgmma-ws": ("MlaWgmmaWsKernel",
                 "make WgmmaMla() and WgmmaWsMla() default to true on compute capability 9.0"),
    # FlashInfer's Hopper MLA (kernels/cuda/ops/mla_flashinfer.h), with attnd's plan and merge.
    "flashinfer": ("BatchMLAPageAttentionHopperKernel",
                   "make LibraryMlaChoice() default to kFlashInfer "
                   "(kernels/cuda/backend/cuda_device.cc)"),
    # The gather + cuBLAS GEMMs floor (kernels/cuda/ops/mla_gemm.h); cuBLAS's kernels have no
    # fixed name, so the profile stage takes attnd's softmax between the two GEMMs.
    "gemm": ("SoftmaxKernel",
             "make LibraryMlaChoice() default to kGemm (kernels/cuda/backend/cuda_device.cc); not "
             "batch-invariant"),
}
MLA_DEFAULT = "pipe"
MLA_TOLERANCE = 1e-2  # relative L2 against the SIMT kernel, as the GPU tests' bf16 tolerance


def mla_forms(rows):
    """{context: {form: (ms, checked)}} over cuda_bench's batch-64 sparse MLA rows; checked is
    whether its output is within MLA_TOLERANCE of the SIMT kernel's (NaN or no check: not)."""
    forms = {}
    for r in rows:
        m = re.fullmatch(r"sparse MLA decode \(([a-z-]+)(?:, split-K x\d+)?\)", r.get("op", ""))
        ctx = re.search(r"ctx=(\d+K)", r.get("shape", ""))
        if not m or m.group(1) not in MLA_FORMS or not ctx or not r["shape"].startswith("B=64 "):
            continue
        err = re.search(r"rel L2 ([0-9.e+-]+) vs SIMT", r.get("check") or "")
        checked = err is not None and float(err.group(1)) <= MLA_TOLERANCE
        forms.setdefault(ctx.group(1), {})[m.group(1)] = (r["ms"], checked)
    return forms


def fastest_mla(rows):
    """The form fastest over every context among those checked in all of them, or None."""
    forms = mla_forms(rows)
    if not forms:
        return None
    names = set.intersection(*({f for f, (_, ok) in by.items() if ok} for by in forms.values()))
    if not names:
        return None
    return min(names, key=lambda f: sum(by[f][0] for by in forms.values()))


def mla_choice(rows):
    forms = mla_forms(rows)
    if not forms:
        return
    print("\nsparse MLA forms at batch 64 (checked: within "
          f"{MLA_TOLERANCE:g} relative L2 of SIMT):")
    for ctx, by in forms.items():
        ranked = sorted(by.items(), key=lambda kv: kv[1][0])
        print(f"  ctx={ctx}: " + ", ".join(
            f"{f} {ms:.3f} ms{'' if ok else ' (NOT checked)'}" for f, (ms, ok) in ranked))
    best = fastest_mla(rows)
    if best is None:
        print("MLA choice: no form passed its check in every context: keep the default")
        return
    if best == MLA_DEFAULT or any(MLA_DEFAULT not in by for by in forms.values()):
        print(f"MLA choice: {best} ({MLA_FORMS[best][1]})")
        return
    # Both sums over the same contexts (every form chosen is in all of them).
    gain = (sum(by[MLA_DEFAULT][0] for by in forms.values()) /
            sum(by[best][0] for by in forms.values()))
    print(f"MLA choice: {best}, {gain:.2f}x the default ({MLA_DEFAULT}) over these contexts: "
          f"{MLA_FORMS[best][1]}")


def stage_table(stages):
    """The stages as gpu-check ran them, then the sanitizer's verdict and the reruns."""
    print("| stage | limit | took | verdict | note |")
    print("|---|---|---|---|---|")
    for s in stages:
        print(f"| {s['stage']} | {s['limit_s']} s | {s['seconds']} s | {s['verdict']} | "
              f"{s['note']} |")
    sanitizer = [s for s in stages if s["stage"].startswith(("sanitizer", "memcheck",
                                                             "racecheck", "synccheck"))]
    verdicts = {s["verdict"] for s in sanitizer}
    word = ("not run" if not sanitizer or verdicts == {"skipped"}
            else "unavailable" if verdicts == {"unavailable"}
            else "clean" if verdicts == {"passed"} else "errors or not finished")
    print(f"\ncompute-sanitizer: {word}"
          + "".join(f"; {s['stage']}: {s['verdict']}" for s in sanitizer))
    reruns = next((s for s in stages if s["stage"] == "reruns"), None)
    if reruns:
        print(f"reruns: {reruns['verdict']} ({reruns['note']})")
    print()


def e2e_line(run, path):
    """One line of e2e.jsonl from an `attnctl bench --output json` report: the latent bf16
    variant's per-layer server time, round trip and transport (p50, ms)."""
    with open(path) as f:
        report = json.load(f)
    v = next(v for v in report["variants"] if v["name"] == "latent bf16")
    return {"run": run, "batch": report["batch"], "context": report["context"],
            "heads": report["heads"], "layers": report["layers"],
            "server_ms": v["server_ms_p50"], "round_trip_ms": v["round_trip_ms_p50"],
            "transport_ms": v["transport_ms_p50"]}


def e2e_table(runs, rows):
    """The end-to-end runs: the server's layer time beside its round trip, and beside the sum of
    the kernels cuda_bench timed at the same batch and context where it has them (the mean layer
    of F/S/F/S: the MLA each layer, the indexer + top-k every other)."""
    if not runs:
        return
    print("\nend to end (attnctl bench against attnd, per layer, p50):")
    print("| run | shape | server | round trip | transport | kernels' sum | server / kernels |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        ctx = f"ctx={r['context'] // 1024}K"
        shape = f"B={r['batch']} H={r['heads']} {ctx}"
        form = "flashinfer" if "library" in r["run"] else MLA_DEFAULT
        mla = next((x["ms"] for x in rows if x["shape"].startswith(f"B={r['batch']} ")
                    and ctx in x["shape"]
                    and re.fullmatch(rf"sparse MLA decode \({form}(, split-K x\d+)?\)", x["op"])),
                   None)
        topk = r"indexer \([a-z]+\) \+ top-k"
        if "library" in r["run"]:
            topk += r" \(flashinfer\)"
        idx = next((x["ms"] for x in rows if re.fullmatch(topk, x["op"]) and ctx in x["shape"]
                    and x["shape"].startswith(f"B={r['batch']} ")), None)
        kernels = mla + idx / 2 if mla is not None and idx is not None else None
        ratio = f"{r['server_ms'] / kernels:.2f}x" if kernels else "not measured at this shape"
        ks = f"{kernels:.3f} ms" if kernels else "-"
        print(f"| {r['run']} | {shape} | {r['server_ms']:.3f} ms | {r['round_trip_ms']:.3f} ms | "
              f"{r['transport_ms']:.3f} ms | {ks} | {ratio} |")


def main():
    args = sys.argv[1:]
    if args and args[0] == "--e2e-line":
        if len(args) != 3:
            sys.exit(__doc__)
        print(json.dumps(e2e_line(args[1], args[2])))
        return
    if args and args[0] == "--fastest-mla":
        if len(args) != 2:
            sys.exit(__doc__)
        best = fastest_mla(lines(args[1]))
        if best:
            print(MLA_FORMS[best][0])
        return
    stages, e2e = None, []
    while args and args[0].startswith(("--stages=", "--e2e=")):
        flag, path = args.pop(0).split("=", 1)
        if flag == "--stages":
            stages = lines(path)
        else:
            e2e = lines(path)
    if len(args) < 2:
        sys.exit(__doc__)
    if stages is not None:
        stage_table(stages)
    ours, torch_rows = lines(args[0]), lines(args[1])
    missing = []
    passed, failed, skipped, read = count_tests(args[2:], missing)
    for path in missing:
        print(f"GPU tests: no XML at {path} (the binary timed out or crashed, or never ran)")
    if read:
        print(f"GPU tests: {passed} passed, {failed} failed, {skipped} skipped")
        if passed == 0:
            print("GPU tests: none ran")
    else:
        print("GPU tests: not run")
    if not ours:
        print("no GPU: nothing measured")
        return

    def torch_ms(row):
        if not row["shape"].startswith("B=64") and row["op"].startswith("sparse MLA"):
            return None  # the PyTorch version is timed at batch 64 only
        op = re.sub(r" \([^)]*\)", "", row["op"])  # the kernel's variant: the same op
        if op == "prefill MLA":
            op = "prefill MLA (dense causal)"
        for r in torch_rows:
            if r["op"] == op and ("shape_ctx" not in r
                                  or f"ctx={r['shape_ctx'] // 1024}K" in row["shape"]):
                return r["torch_ms"]
        return None

    gemm = next((r for r in torch_rows if r["op"] == "bf16 GEMM (limit)"), None)
    if gemm:
        print(f"bf16 matmul rate (PyTorch, 8192^3): {gemm['tflops']:.1f} TFLOP/s")
        for r in ours:
            if r["unit"] == "TFLOP/s":
                r["frac"] = r["rate"] / gemm["tflops"]
    print()
    print("| op | shape | time | rate | of limit | speed-up over PyTorch | checked |")
    print("|---|---|---|---|---|---|---|")
    for r in ours:
        t = torch_ms(r)
        sp = f"{t / r['ms']:.2f}x" if t else "-"
        frac = f"{100 * r['frac']:.1f}%" if r["frac"] >= 0 else "-"
        print(f"| {r['op']} | {r['shape']} | {r['ms']:.3f} ms | {r['rate']:.1f} {r['unit']} | "
              f"{frac} | {sp} | {r.get('check') or '-'} |")
    mla_choice(ours)
    e2e_table(e2e, ours)


if __name__ == "__main__":
    main()
