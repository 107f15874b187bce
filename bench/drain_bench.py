#!/usr/bin/env python3
"""How fast a drain hands sequences off (docs/lifecycle.md), against how fast a client imports the
same bytes into the same peer in the same run.

Starts two attnd on loopback (a source and its drain peer), imports --sequences sequences of
--context tokens into the source with write-only steps (random bf16 keys), then SIGTERMs the
source and reads its report line ("drained: N sequence(s) ... in X ms"). The peer of the ratio:
importing the same sequences into the peer from this client, timed the same way.

    python3 bench/drain_bench.py --model=deepseek-v3.2 --sequences=8 --context=4096 \
        --drain-parallel=4
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python" / "tests"))
from attnd import AttndClient, LayerInputs  # noqa: E402

from attnd_process import start  # noqa: E402

BF16 = ml_dtypes.bfloat16
CHUNK = 2048  # tokens per write-only step


def chunk_keys(spec, rng):
    """One CHUNK of random keys per layer, reused by every write (the timing measures moving
    bytes, not making them)."""
    layers = []
    for kind in spec.layers:
        x = {"kv_latent": rng.standard_normal((CHUNK, spec.kv_lora_rank)).astype(BF16),
             "k_rope": rng.standard_normal((CHUNK, spec.qk_rope_head_dim)).astype(BF16)}
        if kind == "full":
            x["index_k"] = rng.standard_normal((CHUNK, spec.index_head_dim)).astype(BF16)
        layers.append(x)
    return layers


def import_sequences(client, keys, names, context):
    """Write-only steps of up to CHUNK tokens; returns the bytes sent."""
    sent = 0
    for sid in names:
        client.open_sequence(sid, import_length=context)
        for start_tok in range(0, context, CHUNK):
            t = min(CHUNK, context - start_tok)
            step = client.begin_step([(sid, t)], write_only=True)
            for i, layer in enumerate(keys):
                x = {k: v[:t] for k, v in layer.items()}
                sent += sum(v.nbytes for v in x.values())
                client.attend_layer(step.step_id, LayerInputs(i, **x))
    return sent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="deepseek-v3.2")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--kv-cache-bytes", type=int, default=4 << 30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drain-parallel", type=int, default=4)
    a = ap.parse_args()
    common = [f"--model={a.model}", f"--kv-cache-bytes={a.kv_cache_bytes}", "--metrics-port=0"]
    peer, peer_target, _ = start(common, kv_pages=None, threads=a.threads)
    src, src_target, _ = start(common + [f"--drain-peers={peer_target}",
                                         f"--drain-parallel={a.drain_parallel}"], kv_pages=None,
                               threads=a.threads)
    rng = np.random.default_rng(7)
    try:
        with AttndClient(src_target, timeout=600) as c:
            spec = c.info().model
            keys = chunk_keys(spec, rng)
            names = [f"drain-bench-{i}" for i in range(a.sequences)]
            sent = import_sequences(c, keys, names, a.context)
        with AttndClient(peer_target, timeout=600) as c:
            t0 = time.perf_counter()
            import_sequences(c, keys, [f"client-import-{i}" for i in range(a.sequences)],
                             a.context)
            client_s = time.perf_counter() - t0
            for i in range(a.sequences):
                c.close_sequence(f"client-import-{i}")
        src.send_signal(signal.SIGTERM)
        out, _ = src.communicate(timeout=600)
        m = re.search(r"drained: (\d+) sequence\(s\) handed to \d+ peer\(s\), (\d+) left behind "
                      r"in (\d+) ms", out)
        assert m, out
        moved, left, drain_ms = int(m.group(1)), int(m.group(2)), int(m.group(3))
        assert moved == a.sequences and left == 0 and src.returncode == 0, out
        with AttndClient(peer_target, timeout=60) as c:
            held = {s.sequence_id: s.length for s in c.list_sequences()}
        assert all(held.get(n) == a.context for n in names), held
    finally:
        for p in (src, peer):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=60)
    mb = sent / 1e6
    drain_s = drain_ms / 1000
    print(f"model {spec.name}: {a.sequences} sequences x {a.context} tokens = {mb:.0f} MB of keys")
    print(f"drain ({a.drain_parallel} at once): {drain_ms} ms, {mb / drain_s:.0f} MB/s, "
          f"{drain_s / a.sequences * 1000:.0f} ms per sequence")
    print(f"client import of the same bytes into the peer: {client_s * 1000:.0f} ms, "
          f"{mb / client_s:.0f} MB/s")
    print(f"drain / client import time: {drain_s / client_s:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
