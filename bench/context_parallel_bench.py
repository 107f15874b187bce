#!/usr/bin/env python3
"""What context parallelism costs (docs/numerics.md): a decode step of one sequence split over
--parts attnd servers against the same step on one server holding the whole sequence, in the
same run; and the extra round trip a full layer pays for its candidates exchange.

Starts --parts + 1 attnd on loopback (bf16 caches), imports --context random tokens (each part
its slice, the whole server all of them) with write-only steps, then runs --steps decode steps
both ways and prints the medians: step time, the candidates round trip per full layer, and the
candidates' bytes per query per server.

    python3 bench/context_parallel_bench.py --base=deepseek-v3.2 --layers=FS --context=16384 \\
        --parts=2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client" / "python"))
sys.path.insert(0, str(ROOT / "client" / "python" / "tests"))
from attnd import AttndClient, ContextParallelSequence, LayerInputs  # noqa: E402

from attnd_process import start  # noqa: E402

BF16 = ml_dtypes.bfloat16
CHUNK = 2048


def layer_tensors(spec, kind, T, rng, queries=True):
    x = {"kv_latent": rng.standard_normal((T, spec.kv_lora_rank)),
         "k_rope": rng.standard_normal((T, spec.qk_rope_head_dim))}
    if kind == "full":
        x["index_k"] = rng.standard_normal((T, spec.index_head_dim))
    if queries:
        x["q_latent"] = rng.standard_normal((T, spec.num_heads, spec.kv_lora_rank))
        x["q_rope"] = rng.standard_normal((T, spec.num_heads, spec.qk_rope_head_dim))
        if kind == "full":
            x["index_q"] = rng.standard_normal((T, spec.index_n_heads, spec.index_head_dim))
            x["index_w"] = rng.standard_normal((T, spec.index_n_heads))
    return {k: v.astype(BF16) for k, v in x.items()}


def import_keys(client, sid, spec, n, rng):
    """n random tokens into `sid` with write-only steps."""
    for done in range(0, n, CHUNK):
        T = min(CHUNK, n - done)
        st = client.begin_step([(sid, T)], write_only=True)
        for i, kind in enumerate(spec.layers):
            x = layer_tensors(spec, kind, T, rng, False)
            client.attend_layer(st.step_id, LayerInputs(i, **x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="deepseek-v3.2")
    p.add_argument("--layers", default="FS")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--parts", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="attnd-cp-") as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps({"base": a.base, "name": "cp-bench", "layers": a.layers}))
        procs = [start([f"--model-file={spec_file}"], kv_pages=None, threads=a.threads)
                 for _ in range(a.parts + 1)]
        try:
            clients = [AttndClient(t, timeout=600) for _, t, _ in procs]
            spec = clients[0].info().model
            ps = spec.page_size
            slice_len = (a.context // a.parts + ps - 1) // ps * ps
            starts = [k * slice_len for k in range(a.parts)]
            rng = np.random.default_rng(1)
            whole = clients[-1]
            whole.open_sequence("s")
            import_keys(whole, "s", spec, a.context, rng)
            seq = ContextParallelSequence(clients[:-1], starts, "s")
            seq.open()
            for k in range(a.parts):
                hi = starts[k + 1] if k + 1 < a.parts else a.context
                import_keys(clients[k], "s", spec, hi - starts[k], rng)
            seq.length = a.context  # imported into each slice directly, not through steps
            one, split, exchange, cand_bytes = [], [], [], []
            full = sum(1 for kind in spec.layers if kind == "full")
            for _ in range(a.steps):
                layers = [layer_tensors(spec, kind, 1, rng) for kind in spec.layers]
                t0 = time.perf_counter()
                st = whole.begin_step([("s", 1)])
                for i, x in enumerate(layers):
                    whole.attend_layer(st.step_id, LayerInputs(i, **x))
                one.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                seq.step(1, layers)
                split.append(time.perf_counter() - t0)
                exchange.append(seq.candidates_seconds / max(1, full))
            keep = spec.index_topk if not spec.selection.startswith("page_budget") else \
                int(spec.selection.split(":")[1])
            cand_bytes = keep * (8 + 4)  # a key (int64) and a score (float) per candidate
            med = statistics.median
            print(f"{a.base} dims, layers {a.layers}, context {a.context} over {a.parts} servers "
                  f"(slices of {slice_len}), decode batch 1, {a.steps} steps, "
                  f"{a.threads} threads per server")
            print(f"{'step on one server':36s} {med(one) * 1e3:9.2f} ms")
            print(f"{'step split over the servers':36s} {med(split) * 1e3:9.2f} ms "
                  f"({med(split) / med(one):.2f}x)")
            print(f"{'candidates round trip per full layer':36s} {med(exchange) * 1e3:9.2f} ms "
                  f"(about {cand_bytes / 1024:.0f} KiB of candidates per query per server)")
            seq.close()
        finally:
            for proc, _, _ in procs:
                proc.send_signal(signal.SIGTERM)
            for proc, _, _ in procs:
                proc.wait(timeout=60)


if __name__ == "__main__":
    main()
