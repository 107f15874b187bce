"""FP8_E4M3 queries on the wire (docs/numerics.md) through a real server: q_latent, q_rope and
index_q as e4m3 codes with one float32 scale per token and head, a quarter of fp32's bytes; the
server attends with code x scale, so a call equals the same call with those dequantised values in
FP32 (the same selections, bit-identical log-sum-exps) and matches the float64 reference on them;
the output comes back as BF16; malformed scales are refused with nothing written."""

from __future__ import annotations

import grpc
import ml_dtypes
import numpy as np
import pytest

from attnd import AttndClient, Fp8Tensor, quantize_fp8, to_tensor
from attnd.v1 import attention_pb2 as pb

from attnd_process import start, stop
from attnd_testlib import decode_with_lse as _decode
from attnd_testlib import fp32_keys as _keys
from attnd_testlib import fp32_queries as _queries
from attnd_testlib import key_rows as _rows
from attnd_testlib import reference_attention as _reference
from attnd_testlib import rel_err as _rel
from attnd_testlib import write_keys as _write


@pytest.fixture(scope="module")
def target():
    proc, target, _ = start(["--cache-dtype=fp32"], kv_pages=64)
    yield target
    stop(proc)


def _fp8(queries):
    return [{k: quantize_fp8(v) if k in ("q_latent", "q_rope", "index_q") else v
             for k, v in q.items()} for q in queries]


def _dequantized(queries):
    return [{k: v.dequantize() if isinstance(v, Fp8Tensor) else v for k, v in q.items()}
            for q in queries]


def test_quantize_fp8_keeps_one_scale_per_row_and_rounds_to_e4m3():
    x = np.random.default_rng(1).standard_normal((3, 4, 40)).astype(np.float32) * 7
    x[1, 2] = 0
    q = quantize_fp8(x)
    assert q.codes.dtype == ml_dtypes.float8_e4m3fn and q.scales.shape == (3, 4, 1)
    np.testing.assert_allclose(q.scales[..., 0], np.maximum(np.abs(x).max(-1), 0) / 448 +
                               (np.abs(x).max(-1) == 0), rtol=1e-7)
    assert float(np.abs(q.codes.astype(np.float32)).max()) == 448.0
    err = np.abs(q.dequantize() - x) / np.abs(x).max(-1, keepdims=True).clip(1e-30)
    assert err.max() <= 2.0 ** -4  # at most half an e4m3 step of the top binade (16 of 448)
    with pytest.raises(ValueError, match="NaN or infinity"):
        quantize_fp8(np.array([[1.0, np.nan]]))
    # Rows of tiny values keep a nonzero (smallest normal) scale: no inf or NaN codes.
    tiny = quantize_fp8(np.full((2, 8), 1e-44, dtype=np.float32))
    assert (tiny.scales > 0).all() and np.isfinite(tiny.codes.astype(np.float32)).all()


def test_fp8_queries_equal_their_dequantised_values_and_the_float64_reference(target):
    rng = np.random.default_rng(11)
    with AttndClient(target, timeout=30) as c:
        spec = c.info().model
        n = 40  # > K = 24: full and shared layers select
        keys, new_key = _keys(spec, n, rng), _keys(spec, 1, rng)
        queries = _fp8(_queries(spec, rng))
        for sid in ("f8", "f32"):
            c.open_sequence(sid)
            _write(c, sid, keys)
        got = _decode(c, "f8", new_key, queries)
        want = _decode(c, "f32", new_key, _dequantized(queries))
        for layer, (kind, g, w) in enumerate(zip(spec.layers, got, want)):
            assert g.out.dtype == ml_dtypes.bfloat16 and w.out.dtype == np.float32
            assert not np.isnan(g.out.astype(np.float32)).any()
            assert all(np.array_equal(a, b) for a, b in zip(g.attended, w.attended)), layer
            assert np.array_equal(g.lse, w.lse), layer  # the same fp32 values, the same sums
            np.testing.assert_array_equal(g.out, w.out.astype(ml_dtypes.bfloat16))
            deq = {k: v.dequantize() for k, v in queries[layer].items() if isinstance(v, Fp8Tensor)}
            ref_out, ref_lse = _reference(spec, kind, _rows(keys, new_key, layer)[g.attended[0]],
                                          deq)
            np.testing.assert_allclose(g.lse[0], ref_lse, rtol=1e-6, atol=1e-5)
            assert _rel(g.out[0].astype(np.float32), ref_out) <= 1e-2  # bf16 output rounding
            assert _rel(w.out[0], ref_out) <= 1e-5


def test_fp8_queries_take_a_quarter_of_the_fp32_bytes():
    x = np.random.default_rng(2).standard_normal((8, 16, 576)).astype(np.float32)
    fp8 = quantize_fp8(x).to_tensor()
    assert fp8.datatype == "FP8_E4M3" and list(fp8.scales.shape) == [8, 16, 1]
    assert fp8.ByteSize() <= 0.26 * x.nbytes  # codes plus 4 bytes per 576 values


@pytest.mark.parametrize("bad,message", [
    ("none", "one FP32 scale per token and head, scales [1, 4, 1]; none given"),
    ("two", "one FP32 scale per token and head, scales [1, 4, 1]; got 2 per row"),
    ("zero", "is not a positive finite number"),
    ("negative", "is not a positive finite number"),
    ("inf", "is not a positive finite number"),
    ("huge", "of at most 3.4e38 / 448"),  # 448 x scale would overflow
    ("index_w", "FP8_E4M3 is taken for queries"),
])
def test_malformed_fp8_queries_are_refused_and_nothing_is_written(target, bad, message):
    rng = np.random.default_rng(3)
    with AttndClient(target, timeout=30) as c:
        spec = c.info().model
        sid = f"bad-{bad}"
        c.open_sequence(sid)
        new_key, queries = _keys(spec, 1, rng), _queries(spec, rng)
        q = quantize_fp8(queries[0]["q_latent"])
        if bad == "none":
            q_msg = pb.Tensor(datatype="FP8_E4M3", shape=list(q.shape),
                              data=q.codes.view(np.uint8).tobytes())
        else:
            scales = {"two": np.repeat(q.scales, 2, axis=-1), "zero": q.scales * 0,
                      "negative": -q.scales, "inf": q.scales * np.inf,
                      "huge": np.full_like(q.scales, 1e36)}.get(bad, q.scales)
            q_msg = Fp8Tensor(q.codes, scales.astype(np.float32)).to_tensor()
        inputs = pb.LayerInputs(layer=0, q_latent=q_msg)
        x = dict(new_key[0], **queries[0])
        for name in ("q_rope", "kv_latent", "k_rope", "index_q", "index_k", "index_w"):
            if name == "index_w" and bad == "index_w":
                getattr(inputs, name).CopyFrom(quantize_fp8(x[name]).to_tensor())
                continue
            getattr(inputs, name).CopyFrom(to_tensor(x[name]))
        step = c.begin_step([(sid, 1)])
        with pytest.raises(grpc.RpcError) as e:
            c._stub.AttendLayer(pb.AttendLayerRequest(step_id=step.step_id, inputs=inputs),
                                timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert message in e.value.details(), e.value.details()
        assert c.describe_sequence(sid).length == 0
        assert not c.describe_sequence(sid).in_step
