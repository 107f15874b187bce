"""The layer call's two forms (#33): ``attend_layer(step_id, LayerInputs(...))`` /
``stream.layer(LayerInputs(...))`` / ``await astream.layer(LayerInputs(...))`` with fixed return
types, and the previous release's keyword form, which still works with a DeprecationWarning and
returns what it returned: the same messages on the wire and bit-identical replies."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from attnd import AsyncAttndClient, AttndClient, Candidates, LayerInputs, LayerResult
from attnd.v1 import attention_pb2 as pb

from attnd_testlib import bits

STYLES = ["unary", "stream", "async_stream"]
NEW = {"unary": "attend_layer", "stream": "layer", "async_stream": "layer"}


def _tensors(T, H=4, L=8, R=4, seed=0):
    rng = np.random.default_rng(seed)
    return {"q_latent": rng.standard_normal((T, H, L)).astype(np.float32),
            "q_rope": rng.standard_normal((T, H, R)).astype(np.float32),
            "kv_latent": rng.standard_normal((T, L)).astype(np.float32),
            "k_rope": rng.standard_normal((T, R)).astype(np.float32)}


# ---- without a server: the messages ----------------------------------------------------------


class _Captured(Exception):
    pass


def _request_of(call):
    """The AttendLayerRequest a unary call would send (the client's transport replaced)."""
    client = AttndClient("127.0.0.1:1")  # never connects
    sent = []

    def unary(rpc, request, convert=None):
        sent.append(request)
        raise _Captured

    client._unary = unary
    with pytest.raises(_Captured):
        call(client)
    client.close()
    return sent[0].SerializeToString(deterministic=True)


@pytest.mark.parametrize("flags, new_call", [
    ({}, "attend_layer"),
    ({"details": True}, "attend_layer_details"),
    ({"lse": True, "attended": True}, "attend_layer_details"),
    ({"out_datatype": "FP32", "shard": 1}, "attend_layer"),
    ({"candidates": True}, "attend_layer_candidates"),
])
def test_the_keyword_form_sends_the_same_message_and_names_the_new_call(flags, new_call):
    x = _tensors(3)
    fields = {"return_lse": flags.get("lse", False),
              "return_attended": flags.get("attended", False),
              **{k: v for k, v in flags.items() if k in ("out_datatype", "shard")}}
    with pytest.warns(DeprecationWarning, match=rf"call {new_call}\(attnd\.LayerInputs"):
        old = _request_of(lambda c: c.attend_layer(7, 2, **x, **flags))
    new = _request_of(lambda c: getattr(c, new_call)(7, LayerInputs(2, **x, **fields)))
    assert old == new
    msg = pb.AttendLayerRequest.FromString(new)
    assert (msg.step_id, msg.inputs.layer) == (7, 2)
    assert msg.inputs.return_candidates == bool(flags.get("candidates"))
    assert msg.inputs.return_lse == bool(flags.get("lse"))


def test_the_plain_call_refuses_what_only_the_details_call_returns():
    with AttndClient("127.0.0.1:1") as c:
        for field in ("return_lse", "return_attended"):
            with pytest.raises(ValueError, match="attend_layer_details"):
                c.attend_layer(1, LayerInputs(0, **_tensors(1), **{field: True}))
        with pytest.raises(TypeError, match="LayerInputs alone"):
            c.attend_layer(1, LayerInputs(0, **_tensors(1)), lse=True)


# ---- against the session server: the replies -----------------------------------------------


def _run(target, style, sid, layers, *, old, details):
    """One step of ``sid`` over every layer (``layers``: each layer's tensors) through ``style``,
    the keyword form (``old``, each call checked to warn) or the LayerInputs form; ``details``:
    with lse and attended positions. Returns each layer's reply."""
    name = NEW[style] + ("_details" if details else "")
    warns = rf"call {name}\(attnd\.LayerInputs"
    T = layers[0]["kv_latent"].shape[0]

    def call(plain, with_details, i, x):
        if old:
            with pytest.warns(DeprecationWarning, match=warns):
                return plain(i, **x, lse=True, attended=True) if details else plain(i, **x)
        if details:
            return with_details(LayerInputs(i, **x, return_lse=True, return_attended=True))
        return plain(LayerInputs(i, **x))

    async def acall(plain, with_details, i, x):  # the warning comes once the call runs
        if old:
            with pytest.warns(DeprecationWarning, match=warns):
                if details:
                    return await plain(i, **x, lse=True, attended=True)
                return await plain(i, **x)
        if details:
            return await with_details(LayerInputs(i, **x, return_lse=True, return_attended=True))
        return await plain(LayerInputs(i, **x))

    if style == "async_stream":
        async def go():
            async with AsyncAttndClient(target, timeout=60.0) as c:
                if os.environ.get("ATTND_TEST_DATA_PLANE") == "ucx":  # test.sh's pass over it
                    await c.connect_data_plane()
                async with c.stream() as s:
                    await s.begin([(sid, T)])
                    return [await acall(s.layer, s.layer_details, i, x)
                            for i, x in enumerate(layers)]
        return asyncio.run(go())
    with AttndClient(target, timeout=60.0) as c:
        if style == "stream":
            with c.stream() as s:
                s.begin([(sid, T)])
                return [call(s.layer, s.layer_details, i, x) for i, x in enumerate(layers)]
        step = c.begin_step([(sid, T)]).step_id
        return [call(lambda *a, **k: c.attend_layer(step, *a, **k),
                     lambda inputs: c.attend_layer_details(step, inputs), i, x)
                for i, x in enumerate(layers)]


@pytest.mark.parametrize("style", STYLES)
def test_the_keyword_form_returns_what_the_new_form_returns_bit_for_bit(server, harness, style):
    """Twin sequences, the same two steps (a prefill, then a decode with lse and the attended
    positions): one through the keyword form, one through LayerInputs; replies bit-identical, and
    of the fixed types (the output array; a LayerResult from the details call)."""
    h = harness
    old_sid, new_sid = h.open("old"), h.open("new")
    for T, details in ((5, False), (1, True)):
        layers = h.inputs(T)
        got_old = _run(server, style, old_sid, layers, old=True, details=details)
        got_new = _run(server, style, new_sid, layers, old=False, details=details)
        assert len(got_old) == len(got_new) == h.spec.num_layers
        for layer, (a, b) in enumerate(zip(got_old, got_new)):
            if not details:
                assert type(a) is type(b) is np.ndarray, (layer, type(a), type(b))
                assert a.dtype == b.dtype and np.array_equal(bits(a), bits(b)), layer
                continue
            assert type(a) is type(b) is LayerResult, (layer, type(a), type(b))
            assert a.out.dtype == b.out.dtype and np.array_equal(bits(a.out), bits(b.out)), layer
            assert a.lse.dtype == b.lse.dtype == np.float32, layer
            assert np.array_equal(bits(a.lse), bits(b.lse)), layer
            assert len(a.attended) == len(b.attended) == T, layer
            assert all(np.array_equal(x, y) for x, y in zip(a.attended, b.attended)), layer
            assert a.committed == b.committed == (layer == h.spec.num_layers - 1), layer
    for sid in (old_sid, new_sid):
        assert h.client.describe_sequence(sid).length == 6


def test_candidates_come_back_as_candidates(two_servers):
    """A context-parallel full layer's first call: the keyword form (candidates=True) and
    attend_layer_candidates return the same Candidates."""
    got = []
    for k, target in enumerate(two_servers):
        with AttndClient(target, timeout=60.0) as c:
            spec = c.info().model
            full = spec.layers.index("full")
            c.open_sequence("cand")
            step = c.begin_step([("cand", 3)], position_offsets=[0]).step_id
            for i in range(full):
                c.attend_layer(step, LayerInputs(i, **_spec_tensors(spec, 3, "q", i)))
            x = _spec_tensors(spec, 3, "index", full)
            if k == 0:
                with pytest.warns(DeprecationWarning, match=r"attend_layer_candidates\("):
                    got.append(c.attend_layer(step, full, candidates=True, **x))
            else:
                got.append(c.attend_layer_candidates(step, LayerInputs(full, **x)))
            c.abort_step(step)
    a, b = got
    assert type(a) is type(b) is Candidates
    assert (a.pages, a.keep) == (b.pages, b.keep)
    assert np.array_equal(a.count, b.count) and len(a.count) == 3
    assert np.array_equal(a.keys, b.keys) and np.array_equal(bits(a.scores), bits(b.scores))


def _spec_tensors(spec, T, what, layer):
    """Layer ``layer``'s tensors for T tokens (float32, seeded by the layer): "q" the queries and
    keys, "index" the keys and indexer tensors (a candidates call)."""
    rng = np.random.default_rng(layer)
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    x = {"kv_latent": r(T, spec.kv_lora_rank), "k_rope": r(T, spec.qk_rope_head_dim)}
    if what == "q":
        x.update(q_latent=r(T, spec.num_heads, spec.kv_lora_rank),
                 q_rope=r(T, spec.num_heads, spec.qk_rope_head_dim))
    else:
        x.update(index_k=r(T, spec.index_head_dim), index_q=r(T, spec.index_n_heads,
                 spec.index_head_dim), index_w=r(T, spec.index_n_heads))
    return x
