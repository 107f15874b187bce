"""The fp8 cache (--cache-dtype=fp8, docs/architecture.md) through real servers: its pages cost at
most 0.6x the bf16 bytes, an export carries the keys exactly as cached (e4m3 codes with their
power-of-two scales, rope bf16) and decodes to the quantised inputs, an import into a second fp8
server gives a byte-identical cache and bit-identical outputs, and fp8 keys are refused where they
do not belong."""

from __future__ import annotations

import signal

import ml_dtypes
import numpy as np
import pytest

from attnd import AttndClient, AttndError, from_tensor
from attnd.v1 import attention_pb2 as pb

from attnd_process import start, stop
from attnd_testlib import bf16_layers as _layers
from attnd_testlib import run_step as _step


def _export(client, sid):
    return [c.keys.SerializeToString() for c in client.export_sequence(sid, chunk_tokens=16)]


def _quantised(x, tile):
    """x [n, d] float as an fp8 cache stores it: per tile the smallest power-of-two scale with
    amax / scale <= 448, then round to nearest e4m3 (saturating)."""
    x = np.asarray(x, dtype=np.float32)
    t = x.reshape(x.shape[0], -1, tile)
    amax = np.abs(t).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.maximum(amax, 1e-30) / 448.0)), 1.0)
    q = np.clip(t / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (q * scale).reshape(x.shape), scale.reshape(x.shape[0], -1).astype(np.float32)


def test_fp8_pages_cost_at_most_six_tenths_of_bf16():
    procs = [start(["--cache-dtype=fp8", f"--model={m}"], kv_pages=8) for m in ("tiny", "demo")]
    procs += [start(["--cache-dtype=bf16", f"--model={m}"], kv_pages=8) for m in ("tiny", "demo")]
    try:
        infos = []
        for _, target, _ in procs:
            with AttndClient(target, timeout=10) as c:
                infos.append(c.info())
        fp8_tiny, fp8_demo, bf16_tiny, bf16_demo = infos
        assert fp8_demo.cache_datatype == "FP8_E4M3" and "FP8_E4M3" in fp8_demo.datatypes
        # Every server takes FP8_E4M3 queries; only an fp8 one takes FP8 keys.
        assert bf16_demo.cache_datatype == "BF16" and "FP8_E4M3" in bf16_demo.datatypes
        # DeepSeek dims: 656 + 132 bytes per token per full layer against 1152 + 256.
        assert fp8_demo.devices[0].bytes_per_page == 64 * 4 * 656 + 64 * 2 * 132
        assert fp8_demo.devices[0].bytes_per_page <= 0.6 * bf16_demo.devices[0].bytes_per_page
        # The tiny model: one tile of 32 per latent row (32 + 4 + 32 bytes), 16 + 4 per key.
        assert fp8_tiny.devices[0].bytes_per_page == 16 * (4 * 68 + 2 * 20)
    finally:
        for p, _, _ in procs:
            stop(p)


def test_an_export_is_the_cache_and_an_import_reproduces_it_bit_for_bit(fp8_pair):
    ta, tb = fp8_pair
    rng = np.random.default_rng(21)
    with AttndClient(ta, timeout=30) as a, AttndClient(tb, timeout=30) as b:
        spec = a.info().model
        prefill = _layers(spec, 40, rng)
        for sid in ("moved", "twin"):
            a.open_sequence(sid)
            _step(a, sid, prefill)
        chunks = list(a.export_sequence("moved", chunk_tokens=64))
        assert len(chunks) == spec.num_layers
        L, Di = spec.kv_lora_rank, spec.index_head_dim
        for layer, chunk in enumerate(chunks):
            k = chunk.keys
            assert k.kv_latent.datatype == "FP8_E4M3" and list(k.kv_latent.shape) == [40, L]
            assert k.kv_latent.scales.datatype == "FP32"
            assert list(k.kv_latent.scales.shape) == [40, 1]  # L = 32: one tile
            assert k.k_rope.datatype == "BF16"
            # The exported keys are the inputs quantised, as the server's float64 checks assume.
            want, scales = _quantised(prefill[layer]["kv_latent"], L)
            np.testing.assert_array_equal(from_tensor(k.kv_latent.scales), scales)
            np.testing.assert_array_equal(from_tensor(k.kv_latent, dequantize=True), want)
            assert not np.isnan(from_tensor(k.kv_latent, dequantize=True)).any()
            np.testing.assert_array_equal(from_tensor(k.k_rope), prefill[layer]["k_rope"])
            if spec.layers[layer] == "full":
                assert k.index_k.datatype == "FP8_E4M3" and list(k.index_k.scales.shape) == [40, 1]
                want_k, _ = _quantised(prefill[layer]["index_k"], Di)
                np.testing.assert_array_equal(from_tensor(k.index_k, dequantize=True), want_k)
            else:
                assert not k.HasField("index_k")
            err = np.abs(want - prefill[layer]["kv_latent"].astype(np.float32)).max()
            assert 0 < err <= np.abs(prefill[layer]["kv_latent"].astype(np.float32)).max() / 16
        there = a.handoff("moved", b, chunk_tokens=16, close_source=True)
        assert there.length == 40
        # The receiver's cache is the sender's, byte for byte (chunked differently on the way).
        assert _export(b, "moved") == _export(a, "twin")
        decode = _layers(spec, 1, rng)
        moved, twin = _step(b, "moved", decode), _step(a, "twin", decode)
        for m, t in zip(moved, twin):
            assert not np.isnan(m.astype(np.float32)).any()
            np.testing.assert_array_equal(m.view(np.uint16), t.view(np.uint16))
        assert _export(b, "moved") == _export(a, "twin")


def test_fp8_keys_are_refused_where_they_do_not_belong(fp8_pair):
    ta, _ = fp8_pair
    bf16, tbf, _ = start([], kv_pages=64)
    rng = np.random.default_rng(4)
    try:
        with AttndClient(ta, timeout=30) as a, AttndClient(tbf, timeout=30) as plain:
            spec = a.info().model
            a.open_sequence("src")
            _step(a, "src", _layers(spec, 5, rng))
            chunk = next(iter(a.export_sequence("src")))
            keys = chunk.keys

            def write(client, sid, inputs):
                step = client.begin_step([(sid, 5)], write_only=True)
                try:
                    client._call(client._stub.AttendLayer,
                                 pb.AttendLayerRequest(step_id=step.step_id, inputs=inputs))
                finally:
                    try:
                        client.abort_step(step.step_id)
                    except AttndError:
                        pass

            def refused(client, inputs, match):
                client.open_sequence("dst", import_length=5)
                try:
                    with pytest.raises(AttndError, match=match) as e:
                        write(client, "dst", inputs)
                    assert e.value.code.name == "INVALID_ARGUMENT"
                    assert client.describe_sequence("dst").length == 0
                finally:
                    client.close_sequence("dst")

            refused(plain, keys, "FP8_E4M3 keys need an fp8 cache")
            no_scales = pb.LayerInputs()
            no_scales.CopyFrom(keys)
            no_scales.kv_latent.ClearField("scales")
            refused(a, no_scales, "without scales")
            bad = pb.LayerInputs()
            bad.CopyFrom(keys)
            s = from_tensor(bad.kv_latent.scales)
            s[2, 0] = 0.75  # not a power of two
            bad.kv_latent.scales.data = s.astype("<f4").tobytes()
            refused(a, bad, r"scale 0.75 at \[2, 0\] is not a power of two")
            huge = pb.LayerInputs()
            huge.CopyFrom(keys)
            s = from_tensor(huge.kv_latent.scales)
            s[0, 0] = 2.0 ** 120  # 448 x 2^120 would dequantise to infinity
            huge.kv_latent.scales.data = s.astype("<f4").tobytes()
            refused(a, huge, r"is not a power of two in \[2\^-126, 2\^119\]")
            nan = pb.LayerInputs()
            nan.CopyFrom(keys)
            codes = bytearray(nan.kv_latent.data)
            codes[7] = 0x7F  # e4m3's NaN
            nan.kv_latent.data = bytes(codes)
            refused(a, nan, "non-finite")
            wrong_tiles = pb.LayerInputs()
            wrong_tiles.CopyFrom(keys)
            wrong_tiles.kv_latent.scales.shape[:] = [5, 2]
            wrong_tiles.kv_latent.scales.data = b"\0\0\x80\x3f" * 10
            refused(a, wrong_tiles, "keeps 1 per row")
            # An fp8 query needs its own scales, one per token and head (test_fp8_queries.py).
            a.open_sequence("q")
            step = a.begin_step([("q", 1)])
            x = _layers(spec, 1, rng)[0]
            with pytest.raises(AttndError, match="one FP32 scale per token and head"):
                q = pb.LayerInputs(layer=0)
                for name, arr in x.items():
                    getattr(q, name).CopyFrom(pb.Tensor(datatype="BF16", shape=list(arr.shape),
                                                        data=arr.view(np.uint16).tobytes()))
                q.q_rope.datatype = "FP8_E4M3"
                q.q_rope.data = bytes(q.q_rope.data[: len(q.q_rope.data) // 2])
                a._call(a._stub.AttendLayer, pb.AttendLayerRequest(step_id=step.step_id, inputs=q))
            # The refused layer ended its step; nothing changed.
            assert a.describe_sequence("q").length == 0
            assert a.describe_sequence("src").length == 5
    finally:
        stop(bf16)


def test_a_drain_moves_fp8_sequences_to_an_fp8_peer_and_refuses_a_bf16_one():
    fp8_peer, t8, _ = start(["--cache-dtype=fp8"], kv_pages=64)
    bf16_peer, tb, _ = start([], kv_pages=64)
    rng = np.random.default_rng(9)
    try:
        for peer, moves in ((t8, True), (tb, False)):
            src, ts, _ = start(["--cache-dtype=fp8", f"--drain-peers={peer}",
                                "--drain-timeout-ms=20000"], kv_pages=64)
            with AttndClient(ts, timeout=30) as a:
                spec = a.info().model
                a.open_sequence("d")
                _step(a, "d", _layers(spec, 23, rng))
                want = _export(a, "d")
            src.send_signal(signal.SIGTERM)
            out = src.stdout.read()
            assert src.wait(timeout=60) == 0
            with AttndClient(peer, timeout=30) as p:
                if moves:  # byte for byte
                    assert "1 sequence(s) handed to 1 peer(s), 0 left behind" in out, out
                    assert _export(p, "d") == want
                    p.close_sequence("d")
                else:  # said why, and nothing left half-made on the peer
                    assert "0 sequence(s) handed to 1 peer(s), 1 left behind" in out, out
                    assert "caches BF16: this server's fp8 keys move only to an fp8 cache" in out
                    assert p.list_sequences() == []
    finally:
        stop(fp8_peer)
        stop(bf16_peer)
