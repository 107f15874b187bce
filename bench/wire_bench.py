#!/usr/bin/env python3
"""Wire bytes per token per layer and the transport overhead of each way to send a decode layer
(docs/numerics.md): `attnctl bench` against an attnd that holds absorption weights.

Writes a safetensors checkpoint with random kv_b_proj weights for every layer of the model
(--base's dims, --layers' kinds), starts attnd on loopback with --absorb-from=that checkpoint,
runs `attnctl bench` against it and prints its report: for latent bf16, latent with fp8 queries,
absorbed bf16, absorbed with fp8 queries and absorbed with fp8 queries and reply, the KiB per
token per layer (attention and indexer tensors apart), the per-layer round trip over the
stream, the server's compute time, the transport overhead (round trip - server time) and the
bare echo of the same bytes.

    python3 bench/wire_bench.py --base=deepseek-v3.2 --layers=FS --batch=8 --context=4096
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client" / "python" / "tests"))
from attnd_process import start, stop  # noqa: E402

ATTNCTL = Path(os.environ.get("ATTNCTL_BIN", ROOT / "build" / "client" / "attnctl"))
# (num_heads, kv_lora_rank, qk_nope_head_dim, v_head_dim) of the bases this script knows.
DIMS = {"deepseek-v3.2": (128, 512, 128, 128), "glm-5": (64, 512, 192, 256),
        "tiny": (4, 32, 24, 20)}


def write_checkpoint(d: Path, layers: int, heads: int, latent: int, dn: int, v: int,
                     seed: int = 1) -> None:
    """model.safetensors with each layer's kv_b_proj [H*(Dn+V), L] in BF16, and config.json."""
    rng = np.random.default_rng(seed)
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for layer in range(layers):
        w = (rng.standard_normal((heads * (dn + v), latent)) / np.sqrt(latent)).astype(np.float32)
        bits = w.view(np.uint32)
        raw = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()
        header[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = {
            "dtype": "BF16", "shape": [heads * (dn + v), latent],
            "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(d / "model.safetensors", "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        for b in blobs:
            f.write(b)
    (d / "config.json").write_text(json.dumps(
        {"model_type": "deepseek_v32", "qk_nope_head_dim": dn, "v_head_dim": v}))


def run(base: str, layers: str, batch: int, context: int, steps: int, threads: int,
        output: str = "text") -> str:
    """attnctl bench's report (--output=text or json) against a fresh attnd (raises when either
    fails)."""
    heads, latent, dn, v = DIMS[base]
    with tempfile.TemporaryDirectory(prefix="attnd-wire-") as tmp:
        d = Path(tmp)
        spec = d / "spec.json"
        spec.write_text(json.dumps({"base": base, "name": f"{base}-wire", "layers": layers}))
        write_checkpoint(d, len(layers), heads, latent, dn, v)
        page = 64 if base != "tiny" else 16
        pages = batch * ((context + 3 * steps * 5 + page - 1) // page + 2) + 16
        proc, target, _ = start([f"--model-file={spec}", f"--absorb-from={d}"],
                                kv_pages=pages, threads=threads)
        try:
            r = subprocess.run([str(ATTNCTL), "bench", f"--target={target}", f"--batch={batch}",
                                f"--context={context}", f"--steps={steps}",
                                f"--output={output}"],
                               capture_output=True, text=True, timeout=1800)
        finally:
            stop(proc)
        if r.returncode != 0:
            raise RuntimeError(f"attnctl bench failed ({r.returncode}): {r.stderr}")
        return r.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="deepseek-v3.2", choices=sorted(DIMS))
    p.add_argument("--layers", default="FS", help="layer kinds, F full, S shared, D dense")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    a = p.parse_args()
    print(run(a.base, a.layers, a.batch, a.context, a.steps, a.threads), end="")


if __name__ == "__main__":
    main()
