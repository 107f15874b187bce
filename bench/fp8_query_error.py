"""What FP8_E4M3 queries cost in accuracy (docs/numerics.md): one attnd (demo model: DeepSeek-V3.2
dims, 16 heads; fp32 cache) serving the same decode step twice over the same 300 keys, once with
fp32 queries and once with the same queries through quantize_fp8 (one scale per token and head).
Prints the output's rel-L2 change per layer kind and the share of the top-k both keep.

    python3 bench/fp8_query_error.py [--trials 4] [--keys 300]   # K 2048 above the context
    python3 bench/fp8_query_error.py --keys 4000 --trials 2      # the indexer selects

(run from the checkout after building: it starts build/service/attnd through the tests' helper)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client" / "python"), str(ROOT / "client" / "python" / "tests")]

from attnd import AttndClient, quantize_fp8  # noqa: E402

from attnd_process import start, stop  # noqa: E402
from attnd_testlib import decode_with_lse as _decode  # noqa: E402
from attnd_testlib import fp32_keys as _keys  # noqa: E402
from attnd_testlib import fp32_queries as _queries  # noqa: E402
from attnd_testlib import write_keys as _write  # noqa: E402

QUERIES = ("q_latent", "q_rope", "index_q")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--keys", type=int, default=300)
    args = ap.parse_args()
    pages = 2 * (args.keys // 64 + 2) + 4  # two sequences at a time
    proc, target, _ = start(["--cache-dtype=fp32", "--model=demo"], kv_pages=pages)
    try:
        rng = np.random.default_rng(0)
        with AttndClient(target, timeout=60) as c:
            spec = c.info().model
            keys, new_key = _keys(spec, args.keys, rng), _keys(spec, 1, rng)
            errs = {k: [] for k in spec.layers}
            kept = []
            for trial in range(args.trials):
                qs = _queries(spec, rng)
                res = {}
                for mode in ("fp32", "fp8"):
                    sid = f"{mode}-{trial}"
                    c.open_sequence(sid)
                    _write(c, sid, keys)
                    res[mode] = _decode(c, sid, new_key, [
                        {n: quantize_fp8(v) if mode == "fp8" and n in QUERIES else v
                         for n, v in q.items()} for q in qs])
                for mode in res:
                    c.close_sequence(f"{mode}-{trial}")
                for layer, kind in enumerate(spec.layers):
                    a = res["fp8"][layer].out.astype(np.float64)
                    b = res["fp32"][layer].out.astype(np.float64)
                    errs[kind].append(np.linalg.norm(a - b) / np.linalg.norm(b))
                    if kind == "full":
                        sa = set(res["fp8"][layer].attended[0])
                        sb = set(res["fp32"][layer].attended[0])
                        kept.append(len(sa & sb) / len(sb))
            print(f"demo model, {args.keys + 1} keys, K {spec.index_topk}, {args.trials} trials")
            for kind, v in errs.items():
                print(f"{kind:7} output rel-L2: mean {np.mean(v):.4f}, worst {np.max(v):.4f}")
            print(f"top-k keys kept: {np.mean(kept):.4f}")
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
