"""The client surface beyond single steps, against real attnd servers: the asyncio client gives
the sync client's results, gRPC health, export and handoff between two servers (outputs after the
move bit-identical), and attnd.spec_from_hf_config agreeing with the server's --hf-config on the
published DeepSeek-V3.2 / GLM-5 / GLM-5.2 configs."""

from __future__ import annotations

import asyncio
import json
import signal

import grpc
import numpy as np
import pytest

from attnd import (
    AsyncAttndClient,
    AttndClient,
    AttndError,
    LayerInputs,
    ShmArena,
    spec_from_hf_config,
)

from attnd_process import start, stop
from attnd_testlib import bf16_layers as _layers  # one step's random bf16 inputs; a step
from attnd_testlib import run_step as _step


def test_the_async_client_gives_the_sync_clients_results(two_servers):
    ta, _ = two_servers
    rng = np.random.default_rng(3)
    with AttndClient(ta, timeout=30) as sync:
        spec = sync.info().model
        assert len(sync.echo(b"y" * 10, response_bytes=100)) == 100
        with pytest.raises(AttndError) as e:
            sync.echo(response_bytes=1 << 40)
        assert e.value.code.name in ("INVALID_ARGUMENT", "OUT_OF_RANGE")
        prefill, decode = _layers(spec, 30, rng), _layers(spec, 1, rng)
        sync.open_sequence("sync")
        _step(sync, "sync", prefill)
        want = _step(sync, "sync", decode)

    async def run():
        async with AsyncAttndClient(ta, timeout=30) as c:
            assert (await c.info()).model == spec
            assert await c.health() == "SERVING" and await c.health("") == "SERVING"
            await c.open_sequence("async")
            # Independent calls overlap on one loop.
            infos = await asyncio.gather(c.describe_sequence("async"), c.describe_sequence("sync"))
            assert [i.length for i in infos] == [0, 31]
            for layers in (prefill, decode):
                step = await c.begin_step([("async", layers[0]["kv_latent"].shape[0])])
                got = [await c.attend_layer(step.step_id, LayerInputs(i, **x))
                       for i, x in enumerate(layers)]
            assert len(await c.echo(b"x" * 1000, response_bytes=4096)) == 4096
            with pytest.raises(AttndError) as e:
                await c.describe_sequence("nope")
            assert e.value.code.name == "NOT_FOUND"
            chunks = [ch async for ch in c.export_sequence("async", chunk_tokens=16)]
            assert len(chunks) == 2 * spec.num_layers  # 31 tokens in chunks of 16
            await c.close_sequence("async")
            # The same steps over an async Step stream; an aborted step changes nothing.
            await c.open_sequence("astream")
            async with c.stream(timeout=60) as s:
                for layers in (prefill, decode):
                    await s.begin([("astream", layers[0]["kv_latent"].shape[0])])
                    streamed = [await s.layer(LayerInputs(i, **x)) for i, x in enumerate(layers)]
                    assert s.step is None  # committed
                await s.begin([("astream", 1)])
                await s.layer(LayerInputs(0, **decode[0]))
                await s.abort()
                assert (await c.describe_sequence("astream")).length == 31
                with pytest.raises(AttndError) as e:
                    await s.layer(LayerInputs(0, **decode[0]))  # no step open: the stream ends
                assert s.closed
            await c.close_sequence("astream")
            for a, b in zip(streamed, got):
                np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
            return got

    got = asyncio.run(run())
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.view(np.uint16), w.view(np.uint16))


def test_health_turns_not_serving_in_a_drain():
    peer, peer_target, _ = start([])
    proc, target, _ = start([f"--drain-peers={peer_target}"])
    with AttndClient(target, timeout=10) as c:
        assert c.health() == "SERVING" and c.health("") == "SERVING"
        assert c.health("no.such.Service") == "SERVICE_UNKNOWN"
        c.open_sequence("hold")
        step = c.begin_step([("hold", 1)])  # an open step holds the drain before the moves
        proc.send_signal(signal.SIGTERM)
        for _ in range(200):
            if c.health() == "NOT_SERVING":
                break
        assert c.health() == "NOT_SERVING" and c.health("") == "SERVING"
        c.abort_step(step.step_id)
    assert proc.wait(timeout=60) == 0
    with AttndClient(peer_target, timeout=10) as p:
        assert [s.sequence_id for s in p.list_sequences()] == ["hold"]
    stop(peer)


def test_handoff_moves_a_sequence_whose_next_outputs_are_bit_identical(two_servers):
    ta, tb = two_servers
    rng = np.random.default_rng(8)
    with AttndClient(ta, timeout=30) as a, AttndClient(tb, timeout=30) as b:
        spec = a.info().model
        prefill, decode = _layers(spec, 40, rng), _layers(spec, 1, rng)
        for sid in ("moved", "twin"):
            a.open_sequence(sid)
            _step(a, sid, prefill)
        there = a.handoff("moved", b, chunk_tokens=16, close_source=True)
        assert there.length == 40 and not there.importing
        assert [s.sequence_id for s in a.list_sequences()] == ["twin"]
        moved, twin = _step(b, "moved", decode), _step(a, "twin", decode)
        for m, t in zip(moved, twin):
            np.testing.assert_array_equal(m.view(np.uint16), t.view(np.uint16))
        # A failed handoff leaves nothing behind on the receiver: refused at once, or broken off
        # in the middle of a write-only step there (the step is aborted, then the copy closed).
        with pytest.raises(AttndError):
            a.handoff("twin", b, chunk_tokens=10 ** 9)  # beyond the server's chunk limit
        assert [s.sequence_id for s in b.list_sequences()] == ["moved"]
        real = a.export_sequence

        def broken(sid, chunk_tokens=0):
            for i, chunk in enumerate(real(sid, chunk_tokens)):
                if i == spec.num_layers + 1:  # the second chunk's layer 1: a step is open there
                    raise AttndError(grpc.StatusCode.UNAVAILABLE, "connection lost")
                yield chunk
        a.export_sequence = broken
        with pytest.raises(AttndError, match="connection lost"):
            a.handoff("twin", b, chunk_tokens=16)
        del a.export_sequence
        assert [s.sequence_id for s in b.list_sequences()] == ["moved"]
        assert a.describe_sequence("twin").length == 41

        async def async_handoff():
            async with AsyncAttndClient(ta, timeout=30) as aa, \
                    AsyncAttndClient(tb, timeout=30) as ab:
                # The async form runs the same plan: broken off in a write-only step there, it
                # leaves nothing behind either.
                real_async = aa.export_sequence

                async def broken_async(sid, chunk_tokens=0):
                    i = 0
                    async for chunk in real_async(sid, chunk_tokens):
                        if i == spec.num_layers + 1:
                            raise AttndError(grpc.StatusCode.UNAVAILABLE, "connection lost")
                        i += 1
                        yield chunk
                aa.export_sequence = broken_async
                with pytest.raises(AttndError, match="connection lost"):
                    await aa.handoff("twin", ab, chunk_tokens=16)
                del aa.export_sequence
                assert [s.sequence_id for s in await ab.list_sequences()] == ["moved"]
                return await aa.handoff("twin", ab, chunk_tokens=16, close_source=True)
        assert asyncio.run(async_handoff()).length == 41
        twin_b = _step(b, "twin", _layers(spec, 1, rng))
        assert [s.sequence_id for s in a.list_sequences()] == []
        assert twin_b[-1].shape == (1, spec.num_heads, spec.kv_lora_rank)


# The published configs' fields attnd reads (as in tests/unit/model_spec_test.cc).
PUBLISHED = {
    "deepseek-v3.2": {"model_type": "deepseek_v32", "num_hidden_layers": 61,
                      "num_attention_heads": 128, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                      "qk_rope_head_dim": 64, "index_n_heads": 64, "index_head_dim": 128,
                      "index_topk": 2048, "max_position_embeddings": 163840,
                      "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
                                       "mscale": 1.0, "mscale_all_dim": 1.0,
                                       "original_max_position_embeddings": 4096, "type": "yarn"}},
    "glm-5": {"model_type": "glm_moe_dsa", "num_hidden_layers": 78, "num_attention_heads": 64,
              "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
              "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
              "max_position_embeddings": 202752,
              "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}},
    "glm-5.2": {"model_type": "glm_moe_dsa", "num_hidden_layers": 78, "num_attention_heads": 64,
                "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
                "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
                "index_topk_freq": 4, "index_skip_topk_offset": 3,
                "max_position_embeddings": 1048576,
                "rope_parameters": {"rope_theta": 8000000, "rope_type": "default"}},
}


# Edge cases the two readers must take alike: an empty rope_parameters is the default type (the
# older rope_scaling is not consulted); a null one falls through to rope_scaling.
PUBLISHED["empty-rope-parameters"] = dict(PUBLISHED["deepseek-v3.2"], rope_parameters={})
PUBLISHED["null-rope-parameters"] = dict(PUBLISHED["deepseek-v3.2"], rope_parameters=None)


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_spec_from_hf_config_is_what_the_server_serves(preset, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(PUBLISHED[preset]))
    proc, target, _ = start([f"--hf-config={path}"], kv_pages=2)
    try:
        with AttndClient(target, timeout=30) as c:
            served = c.info().model
    finally:
        stop(proc)
    want = spec_from_hf_config(PUBLISHED[preset])
    for k, v in want.items():
        got = getattr(served, k)
        if k == "sm_scale":
            assert got == pytest.approx(v, rel=1e-12), k
        else:
            assert (tuple(got) if k == "layers" else got) == v, k
    if preset == "glm-5.2":
        assert want["layers"][:8] == ("full",) * 3 + ("shared",) * 3 + ("full", "shared")
    if preset == "empty-rope-parameters":
        assert want["sm_scale"] == pytest.approx(192 ** -0.5)
    if preset == "null-rope-parameters":
        assert want["sm_scale"] == pytest.approx(192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)
    for bad in ({"model_type": "llama"}, {"model_type": "deepseek_v32", "num_hidden_layers": "61"},
                {"model_type": "deepseek_v32", "index_topk": 1.5},
                {"model_type": "deepseek_v32", "kv_lora_rank": True}):
        with pytest.raises(ValueError):
            spec_from_hf_config(bad)


def test_attended_positions_are_bounded_before_any_work(tmp_path):
    """A trace that could outgrow ServerInfo's max_attended_positions (a sixteenth of the
    message limit) is refused before the layer runs, and the step is aborted. The bound is what
    the layer can attend: every visible key on a dense layer, at most K per query on the others."""
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"base": "tiny", "layers": "FSFD"}))
    proc, target, _ = start(["--max-message-bytes=1048576", f"--model-file={spec_file}"],
                            kv_pages=128)
    try:
        with AttndClient(target, timeout=30) as c:
            limit = c.info().max_attended_positions
            assert limit == 1048576 // 16
            spec = c.info().model
            c.open_sequence("long")
            layers = _layers(spec, 400, np.random.default_rng(4))  # 400*401/2 = 80200 keys seen
            step = c.begin_step([("long", 400)])
            for i in range(3):  # full and shared layers: 400 queries attend at most K = 24 each
                r = c.attend_layer_details(step.step_id,
                                           LayerInputs(i, return_attended=True, **layers[i]))
                assert sum(len(p) for p in r.attended) == 300 + 24 * 376
            with pytest.raises(AttndError) as e:  # the dense layer would attend all 80200
                c.attend_layer_details(step.step_id,
                                       LayerInputs(3, return_attended=True, **layers[3]))
            assert e.value.code.name == "INVALID_ARGUMENT"
            assert "80200 keys" in e.value.details and str(limit) in e.value.details
            long = c.describe_sequence("long")
            assert long.length == 0 and not long.in_step
            # Without the trace the same step runs.
            step = c.begin_step([("long", 400)])
            outs = [c.attend_layer(step.step_id, LayerInputs(i, **x))
                    for i, x in enumerate(layers)]
            assert outs[-1].shape == (400, spec.num_heads, spec.kv_lora_rank)
    finally:
        stop(proc)


def test_attended_positions_must_fit_the_reply_beside_the_output(tmp_path):
    """DeepSeek dims (16 heads, 4 indexer heads so a layer call fits 1 MiB): 48 queries after
    1226 tokens may attend 60024 keys, under max_attended_positions, but 786 KB of output plus
    300 KB of positions would pass the message limit: refused before the layer runs."""
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"base": "demo", "index_n_heads": 4}))
    proc, target, _ = start(["--max-message-bytes=1048576", f"--model-file={spec_file}"],
                            kv_pages=None)
    try:
        with AttndClient(target, timeout=60) as c:
            spec = c.info().model
            rng = np.random.default_rng(5)
            c.open_sequence("ctx")
            for n in (500, 500, 226):  # 1226 tokens of context, imported
                step = c.begin_step([("ctx", n)], write_only=True)
                for i, x in enumerate(_layers(spec, n, rng, write_only=True)):
                    c.attend_layer(step.step_id, LayerInputs(i, **x))
            layers = _layers(spec, 48, rng)
            step = c.begin_step([("ctx", 48)])
            with pytest.raises(AttndError) as e:
                c.attend_layer_details(step.step_id,
                                       LayerInputs(0, return_attended=True, **layers[0]))
            assert e.value.code.name == "INVALID_ARGUMENT"
            assert "60024 positions" in e.value.details and "out_shm" in e.value.details
            assert c.describe_sequence("ctx").length == 1226
            step = c.begin_step([("ctx", 48)])
            outs = [c.attend_layer(step.step_id, LayerInputs(i, **x))
                    for i, x in enumerate(layers)]
            assert outs[0].shape == (48, spec.num_heads, spec.kv_lora_rank)
    finally:
        stop(proc)


def test_an_arena_refuses_an_async_client():
    async def run():
        async with AsyncAttndClient("127.0.0.1:1") as c:
            arena = ShmArena(4096)
            try:
                with pytest.raises(TypeError, match="register_shared_memory"):
                    arena.register(c)
            finally:
                arena.close()
    asyncio.run(run())


class _RpcError(grpc.RpcError):
    """An RpcError as gRPC raises it: code() and details()."""

    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_a_call_ended_by_a_server_shutting_down_is_unavailable():
    """gRPC ends a call that reached a server as it shut down, before a handler took it, with
    CANCELLED "CANCELLED" (tests/unit/client_status_test.cc shows it on a real server): to a client
    that cancelled nothing that is the server going away, a miss to retry, as in the C++ client.
    A call the client cancelled, and the server's own CANCELLED messages, stay CANCELLED."""
    from attnd import AttndError

    gone = AttndError.from_rpc_error(_RpcError(grpc.StatusCode.CANCELLED, "CANCELLED"))
    assert gone.code == grpc.StatusCode.UNAVAILABLE and "shut down" in gone.details
    for details in ("Locally cancelled by application!", "step aborted by AbortStep"):
        kept = AttndError.from_rpc_error(_RpcError(grpc.StatusCode.CANCELLED, details))
        assert kept.code == grpc.StatusCode.CANCELLED and kept.details == details
    other = AttndError.from_rpc_error(_RpcError(grpc.StatusCode.NOT_FOUND, "CANCELLED"))
    assert other.code == grpc.StatusCode.NOT_FOUND
