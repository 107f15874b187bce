"""Fewer bytes on the wire (docs/numerics.md): the reply's datatype (out_datatype, FP8_E4M3 with
per-token-head power-of-two scales) against the FP32 reply of the same call, and `attnctl bench`'s
wire bytes per token per layer against the bytes each variant must carry (bench/wire_bench.py
starts a real attnd with absorption weights)."""

from __future__ import annotations

import concurrent.futures
import json
import sys
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest

from attnd import AttndClient, AttndError, Fp8Tensor, LayerInputs, ShmArena, quantize_fp8

from attnd_process import start, stop
from attnd_testlib import random_layer

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import wire_bench  # noqa: E402

DN, V = wire_bench.DIMS["tiny"][2:]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("wire")
    wire_bench.write_checkpoint(d, 4, 4, 32, DN, V, seed=5)
    proc, target, _ = start([f"--absorb-from={d}", "--cache-dtype=fp32"], kv_pages=128)
    yield target
    stop(proc)


def _inputs(spec, kind, T, rng, absorbed):
    return random_layer(spec, kind, T, rng, DN if absorbed else None)


def _pow2_e4m3(x):
    """The reference quantisation: per row the smallest power-of-two scale s with
    amax / s <= 448, codes = x / s rounded to e4m3 (nearest even)."""
    amax = np.abs(x).max(axis=-1, keepdims=True).astype(np.float64)
    e = np.ceil(np.log2(np.where(amax > 0, amax / 448.0, 1.0)))
    s = np.where(amax > 0, np.exp2(e), 1.0).astype(np.float32)
    return (x / s).astype(ml_dtypes.float8_e4m3fn), s


@pytest.mark.parametrize("absorbed", [False, True], ids=["latent", "absorbed"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_reply_datatypes_encode_the_fp32_result(server, absorbed, stream):
    """The same calls on two identical sequences: one replied in FP32, the other in FP8_E4M3
    (then BF16 and FP16). Results do not depend on the batch, so each reply is exactly the FP32
    one encoded: codes and scales bit for bit."""
    rng = np.random.default_rng(3 + 2 * absorbed + stream)
    tag = f"{absorbed}-{stream}"
    with AttndClient(server, timeout=60) as c:
        spec = c.info().model
        for sid in ("f32", "fp8", "bf16", "fp16"):
            c.open_sequence(f"{tag}-{sid}")
        worst = 0.0
        for T in (30, 1, 2):  # a prefill past K = 24, a decode step, a short extend
            calls = [_inputs(spec, kind, T, rng, absorbed) for kind in spec.layers]
            replies = {}
            for sid, dt in (("f32", None), ("fp8", "FP8_E4M3"), ("bf16", "BF16"),
                            ("fp16", "FP16")):
                batch = [(f"{tag}-{sid}", T)]
                if stream:
                    with c.stream() as s:
                        s.begin(batch)
                        replies[sid] = [s.layer(LayerInputs(i, out_datatype=dt, **x))
                                        for i, x in enumerate(calls)]
                else:
                    st = c.begin_step(batch)
                    replies[sid] = [c.attend_layer(st.step_id, LayerInputs(i, out_datatype=dt, **x))
                                    for i, x in enumerate(calls)]
            for i in range(len(calls)):
                ref = replies["f32"][i]
                width = V if absorbed else spec.kv_lora_rank
                assert ref.dtype == np.float32 and ref.shape == (T, spec.num_heads, width)
                assert np.isfinite(ref).all() and np.abs(ref).max() > 0
                got = replies["fp8"][i]
                assert isinstance(got, Fp8Tensor) and got.codes.shape == ref.shape
                assert got.scales.shape == (T, spec.num_heads, 1)
                codes, scales = _pow2_e4m3(ref)
                np.testing.assert_array_equal(got.scales, scales)
                np.testing.assert_array_equal(got.codes.view(np.uint8), codes.view(np.uint8))
                deq = got.dequantize()
                err = float(np.linalg.norm(deq.astype(np.float64) - ref) / np.linalg.norm(ref))
                assert 0 < err <= 2.0 ** -4, err  # within half an e4m3 step of each value
                worst = max(worst, err)
                np.testing.assert_array_equal(
                    replies["bf16"][i].astype(np.float32),
                    ref.astype(ml_dtypes.bfloat16).astype(np.float32))
                assert replies["fp16"][i].dtype == np.float16
                np.testing.assert_array_equal(replies["fp16"][i], ref.astype(np.float16))
        assert worst > 1e-3  # fp8 really was applied
        lengths = {c.describe_sequence(f"{tag}-{s}").length for s in ("f32", "fp8", "bf16")}
        assert lengths == {33}


def test_fp8_queries_and_reply_together(server):
    """FP8 queries with an FP8 reply: the reply is the FP32 reply of the same FP8 queries,
    encoded."""
    rng = np.random.default_rng(17)
    with AttndClient(server, timeout=60) as c:
        spec = c.info().model
        for sid in ("q8-a", "q8-b"):
            c.open_sequence(sid)
        calls = [_inputs(spec, kind, 5, rng, True) for kind in spec.layers]
        for x in calls:
            for k in ("q_nope", "q_rope", "index_q"):
                if k in x:
                    x[k] = quantize_fp8(x[k])
        a = c.begin_step([("q8-a", 5)])
        ref = [c.attend_layer(a.step_id, LayerInputs(i, out_datatype="FP32", **x))
               for i, x in enumerate(calls)]
        b = c.begin_step([("q8-b", 5)])
        got = [c.attend_layer(b.step_id, LayerInputs(i, out_datatype="FP8_E4M3", **x))
               for i, x in enumerate(calls)]
        for r, g in zip(ref, got):
            codes, scales = _pow2_e4m3(r)
            np.testing.assert_array_equal(g.scales, scales)
            np.testing.assert_array_equal(g.codes.view(np.uint8), codes.view(np.uint8))


def test_bad_reply_datatypes_are_refused_and_change_nothing(server):
    rng = np.random.default_rng(29)
    with AttndClient(server, timeout=30) as c:
        spec = c.info().model
        c.open_sequence("bad-out")
        x = _inputs(spec, spec.layers[0], 2, rng, False)

        def refused(code, words, **kw):
            st = c.begin_step([("bad-out", 2)], write_only=kw.pop("write_only", False))
            with pytest.raises(AttndError) as e:
                c.attend_layer(st.step_id, LayerInputs(0, **kw))
            assert e.value.code == code and words in e.value.details, e.value.details
            assert c.describe_sequence("bad-out").length == 0  # the step was aborted

        refused(grpc.StatusCode.INVALID_ARGUMENT, "is not one of BF16, FP16, FP32, FP8_E4M3",
                out_datatype="INT8", **x)
        refused(grpc.StatusCode.INVALID_ARGUMENT, "write-only step",
                out_datatype="BF16", kv_latent=x["kv_latent"], k_rope=x["k_rope"],
                index_k=x["index_k"], write_only=True)
        with ShmArena(1 << 16) as arena:  # refused before its region is looked up
            slot = arena.alloc((2, spec.num_heads, spec.kv_lora_rank), np.float32)
            refused(grpc.StatusCode.INVALID_ARGUMENT, "out_shm takes BF16, FP16 or FP32",
                    out_datatype="FP8_E4M3", out=slot, **x)
        # Sharded steps reply in q_latent's datatype.
        st = c.begin_step([("bad-out", 2)], num_shards=2)
        H2 = spec.num_heads // 2

        def shard(k):  # a layer's shard messages wait for each other: sent together
            part = dict(q_latent=x["q_latent"][:, k * H2:(k + 1) * H2],
                        q_rope=x["q_rope"][:, k * H2:(k + 1) * H2])
            if k == 0:
                part.update({n: x[n] for n in ("kv_latent", "k_rope", "index_q", "index_k",
                                               "index_w")})
            try:
                c.attend_layer(st.step_id, LayerInputs(0, shard=k,
                                                       out_datatype="FP32" if k else None, **part))
            except AttndError as e:
                return e
            return None

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            errors = list(pool.map(shard, (0, 1)))
        assert all(e is not None for e in errors)
        assert any(e.code == grpc.StatusCode.INVALID_ARGUMENT and
                   "shard 1: out_datatype is not served on sharded steps" in e.details
                   for e in errors), errors
        assert c.describe_sequence("bad-out").length == 0
        # Still serving: a good call on the same sequence.
        st = c.begin_step([("bad-out", 2)])
        outs = [c.attend_layer(st.step_id, LayerInputs(i, out_datatype="FP8_E4M3",
                                                       **_inputs(spec, k, 2, rng, False)))
                for i, k in enumerate(spec.layers)]
        assert all(np.isfinite(o.dequantize()).all() for o in outs)
        assert c.describe_sequence("bad-out").length == 2


def test_attnctl_bench_reports_each_variants_wire_bytes():
    """attnctl bench against a real attnd holding absorption weights (tiny dims, batch 8): each
    variant's attention bytes per token per layer are what its tensors must carry, plus at most
    40 bytes of message framing per token; the round trip covers the server's time."""
    B = 8
    out = json.loads(wire_bench.run("tiny", "FSFD", batch=B, context=64, steps=2, threads=2,
                                    output="json"))
    assert (out["batch"], out["context"], out["absorbed_measured"]) == (B, 64, True), out
    fields = ["attention_kib_per_token", "indexer_kib_per_token", "request_kib_per_token",
              "reply_kib_per_token", "round_trip_ms_p50", "round_trip_ms_p99", "server_ms_p50",
              "transport_ms_p50", "echo_ms_p50"]
    rows = {v["name"]: [v[f] for f in fields] for v in out["variants"]}
    assert set(rows) == {"latent bf16", "latent fp8 queries", "absorbed bf16",
                         "absorbed fp8 queries", "absorbed fp8 q + reply"}, out
    H, L, R, Di, Hi = 4, 32, 16, 16, 4  # the tiny model
    keys = 2 * (L + R)
    want = {  # bytes per token per layer: queries, new keys, reply (fp8 rows carry a 4-byte scale)
        "latent bf16": 2 * H * L + 2 * H * R + keys + 2 * H * L,
        "latent fp8 queries": H * (L + 4) + H * (R + 4) + keys + 2 * H * L,
        "absorbed bf16": 2 * H * DN + 2 * H * R + keys + 2 * H * V,
        "absorbed fp8 queries": H * (DN + 4) + H * (R + 4) + keys + 2 * H * V,
        "absorbed fp8 q + reply": H * (DN + 4) + H * (R + 4) + keys + H * (V + 4),
    }
    indexer = {False: 2 * Hi * Di + 2 * Di + 2 * Hi, True: Hi * (Di + 4) + 2 * Di + 2 * Hi}
    for name, w in want.items():
        attention, idx, request, reply, rt50, rt99, server, transport, echo = rows[name]
        assert w / 1024 - 0.005 <= attention <= (w + 40) / 1024 + 0.005, (name, attention, w)
        wi = indexer["fp8" in name]
        assert wi / 1024 - 0.005 <= idx <= (wi + 40) / 1024 + 0.005, (name, idx, wi)
        assert 0 < server <= rt50 * 1.5 and rt99 >= rt50 > 0 and transport > 0 and echo > 0
    assert rows["absorbed fp8 q + reply"][0] < rows["absorbed bf16"][0] < rows["latent bf16"][0]
