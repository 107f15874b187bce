"""PyTorch versions of the ops cuda_bench times, on the same shapes and data distribution
(N(0,1), bf16 caches, fp32 accumulation), for the speed-up column of scripts/gpu-check.sh.
The PyTorch versions read contiguous (unpaged) caches, which only favours them."""

import argparse
import json

import torch


def time_ms(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    B, H, L, R, Hi, Di, K = 64, 128, 512, 64, 64, 128, 2048
    D = L + R
    out = []

    # The bf16 matmul rate of this GPU, the limit for compute-bound ops.
    G = 8192
    a = torch.randn(G, G, device=dev, generator=g).bfloat16()
    b = torch.randn(G, G, device=dev, generator=g).bfloat16()
    ms = time_ms(lambda: torch.matmul(a, b))  # noqa: F821 (ruff misreads the later del)
    out.append({"op": "bf16 GEMM (limit)", "torch_ms": ms, "tflops": 2 * G**3 / (ms * 1e-3) / 1e12})
    del a, b

    ctx = 65536
    keys = torch.randn(B, ctx, Di, device=dev, generator=g).bfloat16()
    q = torch.randn(B, Hi, Di, device=dev, generator=g).bfloat16()
    w = torch.randn(B, Hi, device=dev, generator=g)

    def indexer():
        s = torch.matmul(keys, q.transpose(1, 2)).float().relu_()  # noqa: F821  [B, ctx, Hi]
        return (s * w[:, None, :]).sum(-1)

    out.append({"op": "indexer scores", "shape_ctx": ctx, "torch_ms": time_ms(indexer)})
    out.append({"op": "indexer + top-k", "shape_ctx": ctx,
                "torch_ms": time_ms(lambda: torch.topk(indexer(), K, dim=-1))})
    scores = indexer()
    out.append({"op": "top-k", "shape_ctx": ctx,
                "torch_ms": time_ms(lambda s=scores: torch.topk(s, K, dim=-1))})
    del keys, scores

    for ctx in (8192, 65536):
        kv = torch.randn(B, ctx, D, device=dev, generator=g).bfloat16()
        sel = torch.stack([torch.randperm(ctx, device=dev, generator=g)[:K].sort().values
                           for _ in range(B)])
        ql = torch.randn(B, H, D, device=dev, generator=g).bfloat16()

        def mla():
            kv_sel = torch.gather(kv, 1, sel[:, :, None].expand(B, K, D))  # noqa: B023  [B, K, D]
            s = torch.matmul(ql, kv_sel.transpose(1, 2)).float() * 0.135  # noqa: B023 (run now)
            p = torch.softmax(s, -1)
            return torch.matmul(p.bfloat16(), kv_sel[:, :, :L])

        out.append({"op": "sparse MLA decode", "shape_ctx": ctx, "torch_ms": time_ms(mla)})
        del kv

    T = 4096
    kv = torch.randn(T, D, device=dev, generator=g).bfloat16()
    qp = torch.randn(H, T, D, device=dev, generator=g).bfloat16()
    mask = torch.ones(T, T, device=dev, dtype=torch.bool).tril()

    def prefill():
        res = []
        for c in range(0, T, 1024):
            s = torch.matmul(qp[:, c:c + 1024], kv.T).float() * 0.135  # [H, 1024, T]
            s.masked_fill_(~mask[c:c + 1024], float("-inf"))
            res.append(torch.matmul(torch.softmax(s, -1).bfloat16(), kv[:, :L]))
        return torch.cat(res, 1)

    out.append({"op": "prefill MLA (dense causal)", "torch_ms": time_ms(prefill, reps=3)})
    with open(args.json, "w") as f:
        for r in out:
            f.write(json.dumps(r) + "\n")
    for r in out:
        print(r)


if __name__ == "__main__":
    main()
