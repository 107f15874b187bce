"""Server-side absorption (docs/numerics.md) through real servers: one reads kv_b_proj from a
safetensors checkpoint this test writes (two shards, FP32 and BF16 layers), one gets the same
weights uploaded over RPC, one has none and is driven the worker-side way (q_latent = q_nope @
W_UK sent, W_UV applied by the caller). Absorbed calls send q_nope and receive [T, H, V]; they
equal the worker-side path (fp32, <= 1e-5 relative L2) with the same selections, unary and
streamed, through prefill and decode; the upload gives bit-identical outputs; bad calls are
refused precisely."""

from __future__ import annotations

import concurrent.futures
import json
import struct

import grpc
import numpy as np
import pytest

from attnd import AttndClient, AttndError, LayerInputs

from attnd_process import start, stop
from attnd_testlib import random_layer

DN, V = 24, 20  # qk_nope_head_dim, v_head_dim (the tiny model: H 4, L 32)


def _bf16(x):
    """float32 -> bfloat16 bits (round to nearest even) and the float32 values they hold."""
    b = np.asarray(x, np.float32).view(np.uint32)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return r, (r.astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path, tensors):
    """tensors: name -> (dtype name, shape, raw bytes)."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, (dt, shape, raw) in tensors.items():
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for _, _, raw in tensors.values():
            f.write(raw)


def _name(layer):
    return f"model.layers.{layer}.self_attn.kv_b_proj.weight"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    d = tmp_path_factory.mktemp("absorb")
    spec = d / "spec.json"
    spec.write_text(json.dumps({"base": "tiny", "name": "absorb", "layers": "FSFD",
                                "soft_cap": 30}))
    rng = np.random.default_rng(3)
    H, L, layers = 4, 32, 4
    # Layers 0-1 in FP32 (shard 1), 2-3 in BF16 (shard 2); weights hold what the server reads.
    weights, shard1, shard2 = [], {}, {}
    for layer in range(layers):
        w = (0.3 * rng.standard_normal((H * (DN + V), L))).astype(np.float32)
        if layer < 2:
            shard1[_name(layer)] = ("F32", w.shape, w.tobytes())
            shard1[f"model.layers.{layer}.self_attn.o_proj.weight"] = ("F32", (2,), b"\0" * 8)
        else:
            bits, w = _bf16(w)
            shard2[_name(layer)] = ("BF16", w.shape, bits.tobytes())
        weights.append(w)
    ck = d / "ckpt"
    ck.mkdir()
    write_safetensors(ck / "model-00001-of-00002.safetensors", shard1)
    write_safetensors(ck / "model-00002-of-00002.safetensors", shard2)
    wmap = {n: "model-00001-of-00002.safetensors" for n in shard1}
    wmap.update({n: "model-00002-of-00002.safetensors" for n in shard2})
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    (ck / "config.json").write_text(json.dumps(
        {"model_type": "deepseek_v32", "qk_nope_head_dim": DN, "v_head_dim": V}))
    common = ["--cache-dtype=fp32", f"--model-file={spec}"]
    procs = [start(common + [f"--absorb-from={ck}"], kv_pages=64),
             start(common, kv_pages=64), start(common, kv_pages=64)]
    yield {"absorbing": procs[0][1], "worker": procs[1][1], "upload": procs[2][1],
           "weights": weights, "checkpoint": str(ck)}
    for p in procs:
        stop(p[0])


def _split(w):
    """kv_b_proj [H*(Dn+V), L] -> W_UK [H, Dn, L], W_UV [H, V, L]."""
    w = w.reshape(-1, DN + V, w.shape[-1])
    return w[:, :DN], w[:, DN:]


def _layer_tensors(spec, kind, T, rng):
    return random_layer(spec, kind, T, rng, DN)


def _worker_side(x, w):
    """The same call the worker-side way: q_latent = q_nope @ W_UK in float32."""
    uk, _ = _split(w)
    y = dict(x)
    y["q_latent"] = np.einsum("thd,hdl->thl", y.pop("q_nope"), uk).astype(np.float32)
    return y


def _values(out_latent, w):
    _, uv = _split(w)
    return np.einsum("thl,hvl->thv", out_latent, uv).astype(np.float32)


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def test_info_reports_the_weights_and_their_source(servers):
    with AttndClient(servers["absorbing"], timeout=30) as c:
        a = c.info().absorption
        assert (a.qk_nope_head_dim, a.v_head_dim) == (DN, V)
        assert a.source == f"checkpoint {servers['checkpoint']}"
        assert a.bytes == 4 * 4 * 4 * (DN + V) * 32  # fp32, 4 layers of [H*(Dn+V), L]
    with AttndClient(servers["worker"], timeout=30) as c:
        assert c.info().absorption is None


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_absorbed_calls_equal_the_worker_side_path(servers, stream):
    rng = np.random.default_rng(11 + stream)
    weights = servers["weights"]
    sid = f"s-{stream}"
    with AttndClient(servers["absorbing"], timeout=60) as a, \
            AttndClient(servers["worker"], timeout=60) as b:
        spec = a.info().model
        a.open_sequence(sid)
        b.open_sequence(sid)
        worst = 0.0
        for T in (40, 1, 1, 3, 1):  # prefill past K = 24, then decode and a short extend
            calls = [_layer_tensors(spec, kind, T, rng) for kind in spec.layers]
            if stream:
                with a.stream() as sa, b.stream() as sb:
                    sa.begin([(sid, T)])
                    sb.begin([(sid, T)])
                    got = [sa.layer_details(LayerInputs(i, return_attended=True, **x))
                           for i, x in enumerate(calls)]
                    ref = [sb.layer_details(LayerInputs(i, return_attended=True,
                                                        **_worker_side(x, weights[i])))
                           for i, x in enumerate(calls)]
            else:
                sa = a.begin_step([(sid, T)])
                sb = b.begin_step([(sid, T)])
                got = [a.attend_layer_details(sa.step_id, LayerInputs(i, return_attended=True, **x))
                       for i, x in enumerate(calls)]
                ref = [b.attend_layer_details(sb.step_id, LayerInputs(
                           i, return_attended=True, **_worker_side(x, weights[i])))
                       for i, x in enumerate(calls)]
            for i, (g, r) in enumerate(zip(got, ref)):
                assert g.out.shape == (T, spec.num_heads, V) and g.out.dtype == np.float32
                assert not np.isnan(g.out).any()
                want = _values(r.out, weights[i])
                err = _rel(g.out, want)
                assert err <= 1e-5, (T, i, err)
                worst = max(worst, err)
                for ka, kb in zip(g.attended, r.attended):
                    np.testing.assert_array_equal(ka, kb)
        assert worst > 0  # the comparison is live: two summation orders
        assert a.describe_sequence(sid).length == 46


def test_uploaded_weights_serve_bit_identically(servers):
    rng = np.random.default_rng(21)
    weights = servers["weights"]
    with AttndClient(servers["upload"], timeout=60) as u, \
            AttndClient(servers["absorbing"], timeout=60) as a:
        spec = u.info().model
        calls = [_layer_tensors(spec, kind, 30, rng) for kind in spec.layers]
        u.open_sequence("x")
        step = u.begin_step([("x", 30)])
        with pytest.raises(AttndError) as e:  # no weights yet
            u.attend_layer(step.step_id, LayerInputs(0, **calls[0]))
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "no absorption weights" in e.value.details
        # In several calls (one layer per message at this limit); not in use until the last.
        assert u.upload_absorption(weights, DN, V, max_message_bytes=len(weights[0].tobytes()))
        assert u.info().absorption.source == "upload"
        assert u.upload_absorption(weights, DN, V)  # the same again: a no-op
        other = [w + 1 for w in weights]
        with pytest.raises(AttndError) as e:
            u.upload_absorption(other, DN, V)
        assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(AttndError) as e:  # a wrong shape names the layer
            u.upload_absorption([weights[0][:-1]], DN, V)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "layer 0" in e.value.details
        a.open_sequence("x")
        su, sa = u.begin_step([("x", 30)]), a.begin_step([("x", 30)])
        for i, x in enumerate(calls):
            np.testing.assert_array_equal(u.attend_layer(su.step_id, LayerInputs(i, **x)),
                                          a.attend_layer(sa.step_id, LayerInputs(i, **x)))


def test_bad_absorbed_calls_are_refused_and_change_nothing(servers):
    rng = np.random.default_rng(31)
    with AttndClient(servers["absorbing"], timeout=30) as c:
        spec = c.info().model
        c.open_sequence("bad")
        x = _layer_tensors(spec, "full", 2, rng)

        def refused(**call):
            step = c.begin_step([("bad", 2)])
            with pytest.raises(AttndError) as e:
                c.attend_layer(step.step_id, LayerInputs(0, **call))
            return e.value

        e = refused(q_latent=np.zeros((2, spec.num_heads, spec.kv_lora_rank), np.float32), **x)
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "give one" in e.details
        e = refused(**dict(x, q_nope=x["q_nope"][:, :, :-1]))
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "q_nope" in e.details
        # Sharded steps take q_latent only: both shards' messages, sent together, are refused.
        step = c.begin_step([("bad", 2)], num_shards=2)
        rest = {k: v for k, v in x.items() if k not in ("q_nope", "q_rope")}

        def shard(k):
            part = {n: x[n][:, 2 * k:2 * k + 2] for n in ("q_nope", "q_rope")}
            try:
                c.attend_layer(step.step_id, LayerInputs(0, shard=k, **part,
                                                         **(rest if k == 0 else {})))
            except AttndError as err:
                return err
            return None

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            errors = list(pool.map(shard, [0, 1]))
        assert all(e is not None and e.code == grpc.StatusCode.INVALID_ARGUMENT for e in errors)
        assert any("not served on sharded steps" in e.details for e in errors), errors
        assert c.describe_sequence("bad").length == 0
    with AttndClient(servers["worker"], timeout=30) as c:
        c.open_sequence("bad")
        step = c.begin_step([("bad", 2)])
        with pytest.raises(AttndError) as e:
            c.attend_layer(step.step_id, LayerInputs(0, **x))
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "--absorb-from" in e.value.details


def test_a_bad_checkpoint_stops_the_server_with_the_reason(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v32"}))
    write_safetensors(tmp_path / "model.safetensors", {})
    import subprocess

    from attnd_process import ATTND_BIN
    r = subprocess.run([str(ATTND_BIN), "--model=tiny", "--kv-pages=16", "--grpc-port=0",
                        f"--absorb-from={tmp_path}"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--absorb-from" in r.stderr and _name(0) in r.stderr, r.stderr
