#!/usr/bin/env python3
"""Per-layer transport of each way a decode layer's tensors travel (docs/data-plane.md), one run:
`attnctl transport` against one attnd on loopback (DeepSeek-V3.2 dims, a random absorption
checkpoint so absorbed calls are measured too, --shm, --data-plane=ucx), at each --batches
size, once with the client's UCX limited to shared memory (UCX_TLS=sm; gRPC bytes and shared
memory measured in that pass too) and once to TCP (UCX_TLS=tcp). Writes the markdown table
(--out) with p50/p99 transport beside the bare UCX round trip of the same bytes, their ratio,
and the micro-batch figures. The bare trips are taken one after each UCX-plane call, with that
call's bytes (interleaved: both see the machine as it is then); "paired ratio p50" is the median
over calls of a call's transport over its own bare trip.

    python3 bench/transport_bench.py --batches=8,64 --out=bench/results/transport.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client" / "python" / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from wire_bench import DIMS, write_checkpoint  # noqa: E402

from attnd_process import start, stop  # noqa: E402

ATTNCTL = Path(os.environ.get("ATTNCTL_BIN", ROOT / "build" / "client" / "attnctl"))


def measure(target: str, shm: str, batch: int, context: int, steps: int, tls: str) -> dict:
    env = dict(os.environ, UCX_TLS=tls)
    cmd = [str(ATTNCTL), "transport", f"--target={target}", f"--batch={batch}",
           f"--context={context}", f"--steps={steps}", "--output=json"]
    if tls == "sm":
        cmd.append(f"--shm-target=unix:{shm}")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"attnctl transport failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def table(runs: list[dict]) -> str:
    out = ["| batch | plane | variant | request KiB | reply KiB | transport p50 ms | p99 ms | "
           "bare UCX p50 ms | ratio | bare + control floor | ratio | paired ratio p50 |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        bare = {b["variant"]: b for b in run["bare_ucx"]}
        floor = run["control_ms_p50"]
        for r in run["rows"]:
            if r["plane"] in {"grpc bytes", "shared memory"} and run["ucx_transports"] != "sm":
                continue  # measured once, in the sm pass
            b = bare[r["variant"]]["round_trip_ms_p50"]
            out.append(f"| {run['batch']} | {r['plane']} | {r['variant']} | "
                       f"{r['request_bytes'] / 1024:.0f} | {r['reply_bytes'] / 1024:.0f} | "
                       f"{r['transport_ms_p50']:.3f} | {r['transport_ms_p99']:.3f} | {b:.3f} | "
                       f"{r['transport_ms_p50'] / b:.2f} | {b + floor:.3f} | "
                       f"{r['transport_ms_p50'] / (b + floor):.2f} | "
                       + (f"{r['paired_ratio_p50']:.2f} |" if "paired_ratio_p50" in r else "|"))
    out += ["", "| batch | UCX_TLS | plane | FFN stand-in ms | wait/layer serial p50 | "
            "two in flight p50 | p99 | step of both serial ms | two in flight ms |",
            "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        m = run["micro_batches"]
        out.append(f"| {run['batch']} | {run['ucx_transports']} | {m['plane']} | "
                   f"{m['ffn_ms']:.3f} | {m['serial_wait_ms_p50']:.3f} | "
                   f"{m['overlapped_wait_ms_p50']:.3f} | {m['overlapped_wait_ms_p99']:.3f} | "
                   f"{m['serial_step_ms']:.2f} | {m['overlapped_step_ms']:.2f} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="deepseek-v3.2", choices=sorted(DIMS))
    p.add_argument("--layers", default="FS")
    p.add_argument("--batches", default="8,64")
    # Transport does not depend on the context; a short one keeps the server's compute (which
    # shares this machine's cores with both ends' transport threads) from crowding it out.
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--out", default="")
    p.add_argument("--push", default="false", choices=["true", "false"],
                   help="the server's --data-plane-push (false: clients pull outputs)")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    heads, latent, dn, v = DIMS[a.base]
    runs = []
    with tempfile.TemporaryDirectory(prefix="attnd-transport-") as tmp:
        d = Path(tmp)
        spec = d / "spec.json"
        spec.write_text(json.dumps({"base": a.base, "name": f"{a.base}-transport",
                                    "layers": a.layers}))
        write_checkpoint(d, len(a.layers), heads, latent, dn, v)
        shm = d / "attnd.sock"
        page = 64 if a.base != "tiny" else 16
        rounds = 2 * (3 * 4 + 3)  # planes x variants + micro-batches, two UCX passes
        pages = 2 * max(batches) * ((a.context + rounds * a.steps + page) // page + 2) + 64
        proc, target, _ = start([f"--model-file={spec}", f"--absorb-from={d}", "--shm",
                                 f"--shm-socket={shm}", "--data-plane=ucx",
                                 f"--data-plane-push={a.push}",
                                 "--max-message-bytes=268435456"],
                                kv_pages=pages, threads=a.threads)
        try:
            for batch in batches:
                for tls in ("sm", "tcp"):
                    runs.append(measure(target, str(shm), batch, a.context, a.steps, tls))
        finally:
            stop(proc)
    head = (f"`python3 bench/transport_bench.py --batches={a.batches} --context={a.context} "
            f"--steps={a.steps} --push={a.push}` on {platform.node()} ({os.cpu_count()} cores), "
            f"UCX {runs[0]['ucx_version']}, {a.base} dims ({heads} heads, layers {a.layers}).")
    text = head + "\n\n" + table(runs) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
