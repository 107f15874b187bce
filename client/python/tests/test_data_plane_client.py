"""How the Python clients use their plane (docs/data-plane.md).

A layer call whose outcome the client cannot know (its deadline passed, its task was cancelled,
the connection failed) may still have the server reading its inputs in the plane's input region
and building its output in the output region. That space must go to no other call, or a later
call's bytes would overwrite inputs the server is still reading, and its output could be
another's. The plane is retired instead: the space it holds is never given back, and no call
stages on it once it broke.

A Step stream uses the client's plane of the moment: one opened before the plane connected (the
first calls of a client go as bytes while it connects) or before it was replaced moves its
layers through the new one."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from attnd import AsyncAttndClient, AttndClient, AttndError, LayerInputs
from attnd.data_plane import _off_loop, find_library
from attnd.v1 import attention_pb2 as pb
from attnd.wire import encode_layer

from attnd_process import start, stop
from attnd_testlib import Harness, sample, scrape, wait_for

pytestmark = pytest.mark.skipif(find_library() is None, reason="libattnd_plane.so not built")


def test_a_call_given_up_on_keeps_its_space_and_retires_its_plane():
    proc, target, _ = start(["--data-plane=ucx", "--drain-timeout-ms=500"], kv_pages=512)
    try:
        with AttndClient(target, timeout=30.0) as c:
            first = c.connect_data_plane()
            plane = c._plane_obj
            h = Harness(c, c.info(), seed=21, tag="outcome")
            sid = h.open("seq")
            h.step(c, [(sid, 3)])  # over the plane: its space is given back after each call
            lib, p = plane._lib, plane._p
            assert lib.attnd_plane_take_input(p, 1) == 0, "a finished call kept its space"
            lib.attnd_plane_give_input(p, 0)
            # A prefill long enough that the call's 1 ms deadline passes while the server is
            # still at it: the client cannot know what the server did with the call's space.
            step = c.begin_step([(sid, 2048)])
            c._timeout = 0.001
            with pytest.raises(AttndError) as e:
                c.attend_layer(step.step_id, LayerInputs(0, **h.inputs(2048)[0]))
            c._timeout = 30.0
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
            assert plane.broken
            assert plane.stage(_request(h)) is None, "a broken plane staged a call"
            # The call's space is still taken: the regions' first bytes are not free.
            assert lib.attnd_plane_take_input(p, 1) > 0
            assert lib.attnd_plane_take_output(p, 1) > 0
            c.abort_step(step.step_id)  # taken at once; it ends when the layer under way does
            wait_for(lambda: not c.describe_sequence(sid).in_step, "the step ends", timeout_s=10)
            h.assert_unchanged([sid])
            # The next calls go as bytes while a new plane connects, and then over it.
            h.step(c, [(sid, 1)])
            deadline = time.monotonic() + 10
            while c.data_plane_name in ("", first) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert c.data_plane_name.startswith("ucx-") and c.data_plane_name != first
            h.step(c, [(sid, 1)])
            h.close_all()
    finally:
        stop(proc)


def _request(h: Harness):
    return encode_layer(LayerInputs(0, **h.inputs(1)[0]), uint16_as_bf16=False)


def _moved_in(mport: int) -> float:
    return sample(scrape(mport), 'attnd_data_plane_bytes_total{direction="in"}')


def test_a_stream_opened_before_the_plane_connected_uses_it_once_it_has():
    proc, target, mport = start(["--data-plane=ucx"])
    try:
        with AttndClient(target, timeout=30.0) as c:
            h = Harness(c, c.info(), seed=23, tag="stream-plane")
            sid = h.open("seq")
            with c.stream() as s:  # the client's first call: its plane is not there yet
                assert c.data_plane_name == ""
                h.step(s, [(sid, 2)])
                wait_for(lambda: c.data_plane_name != "", "the plane connects", timeout_s=10)
                before = _moved_in(mport)
                h.step(s, [(sid, 1)])  # checked against float64
                assert _moved_in(mport) > before, "the stream's layers did not use the plane"

            async def run():
                async with AsyncAttndClient(target, timeout=30.0) as ac:
                    async with ac.stream() as s:
                        for _ in range(200):  # the plane connects meanwhile (a task on the loop)
                            if ac.data_plane_name:
                                break
                            x = h.inputs(1)
                            await s.begin([(sid, 1)])
                            outs = [await s.layer(LayerInputs(i, **y)) for i, y in enumerate(x)]
                            h.check(outs, h.ref.step([(sid, 1)], x), x, "as bytes", 1e-2)
                            await asyncio.sleep(0.01)
                        assert ac.data_plane_name.startswith("ucx-")
                        before = _moved_in(mport)
                        x = h.inputs(1)
                        await s.begin([(sid, 1)])
                        outs = [await s.layer(LayerInputs(i, **y)) for i, y in enumerate(x)]
                        h.check(outs, h.ref.step([(sid, 1)], x), x, "over the plane", 1e-2)
                        assert _moved_in(mport) > before, "the async stream did not use the plane"

            asyncio.run(run())
            h.close_all()
    finally:
        stop(proc)


def test_a_closed_stream_leaves_the_clients_plane_alone():
    # A layer on a closed stream is the caller's mistake, refused before anything is staged: it
    # must not break the plane every other call of the client shares.
    proc, target, _ = start(["--data-plane=ucx"])
    try:
        with AttndClient(target, timeout=30.0) as c:
            c.connect_data_plane()
            plane, name = c._plane_obj, c.data_plane_name
            h = Harness(c, c.info(), seed=29, tag="closed-stream")
            sid = h.open("seq")
            s = c.stream()
            s.close()
            with pytest.raises(RuntimeError, match="closed"):
                s.layer(LayerInputs(0, **h.inputs(1)[0]))
            assert not plane.broken and c.data_plane_name == name
            # Closed (a cancel from another thread) after its call was staged, before it went:
            # nothing was sent, so the call's space goes back and the plane stays whole.
            s = c.stream()
            s.begin([(sid, 1)])
            stage = plane.stage

            def stage_then_cancel(msg):
                staged = stage(msg)
                s.cancel()
                return staged
            plane.stage = stage_then_cancel
            try:
                with pytest.raises(RuntimeError, match="closed"):
                    s.layer(LayerInputs(0, **h.inputs(1)[0]))
            finally:
                plane.stage = stage
            assert not plane.broken and c.data_plane_name == name
            assert plane._lib.attnd_plane_take_input(plane._p, 1) == 0, "its space was kept"
            plane._lib.attnd_plane_give_input(plane._p, 0)

            async def run():
                async with AsyncAttndClient(target, timeout=30.0) as ac:
                    await ac.connect_data_plane()
                    aplane, aname = ac._plane_obj, ac.data_plane_name
                    s = ac.stream()
                    await s.close()
                    with pytest.raises(RuntimeError, match="closed"):
                        await s.layer(LayerInputs(0, **h.inputs(1)[0]))
                    assert not aplane.broken and ac.data_plane_name == aname

            asyncio.run(run())
            h.step(c, [(sid, 1)])  # the plane still carries calls, checked against float64
            assert c.data_plane_name == name
            h.close_all()
    finally:
        stop(proc)


def test_a_plane_whose_endpoint_failed_is_not_used_again(monkeypatch):
    """The server's end of a plane went (closed as an idle one is, its worker stopped) and this
    end's UCX noticed (its keepalives over TCP met a closed port): the next layer call goes as
    bytes rather than through the plane (which failed it, NOT_FOUND, and aborted its step), and
    a new plane is connected."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    proc, target, _ = start(["--data-plane=ucx", "--data-plane-keepalive-ms=200",
                             "--data-plane-push=false"])
    try:
        with AttndClient(target, timeout=30.0) as c:
            first = c.connect_data_plane()
            plane = c._plane_obj
            h = Harness(c, c.info(), seed=29, tag="lost")
            sid = h.open("seq")
            h.step(c, [(sid, 2)])
            c._call(c._stub.CloseDataPlane, pb.CloseDataPlaneRequest(plane=first))
            wait_for(lambda: plane._lib.attnd_plane_lost(plane._p) == 1,
                     "this end notices the server's end is gone", timeout_s=10)
            h.step(c, [(sid, 1)])  # as bytes, checked against float64: no failure
            assert plane.broken
            wait_for(lambda: c.data_plane_name not in ("", first), "a new plane", timeout_s=10)
            h.step(c, [(sid, 1)])
            h.close_all()
    finally:
        stop(proc)


def test_work_taken_off_the_loop_ends_before_a_cancel_does():
    """The asyncio client makes, attaches and closes a plane's end in worker threads
    (_off_loop). A cancel (a second one too: a close with its own timeout) must not let the
    caller clean up while the thread still works on that end (destroying it under an attach)."""
    ended = threading.Event()

    def slow() -> None:
        time.sleep(0.3)
        ended.set()

    async def run() -> None:
        task = asyncio.ensure_future(_off_loop(slow))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ended.is_set(), "the cancel came back while the thread still ran"

    asyncio.run(run())
