"""A layer call over the data plane whose outcome the client cannot know (its deadline passed, its
task was cancelled, the connection failed): the server may still be reading the call's inputs in
the plane's input region and building its output in the output region. That space must go to no
other call, or a later call's bytes would overwrite inputs the server is still reading, and its
output could be another's (docs/data-plane.md). The plane is retired instead: the space it holds
is never given back, and no call stages on it once it broke."""

from __future__ import annotations

import time

import grpc
import pytest

from attnd import AttndClient, AttndError, LayerInputs
from attnd.data_plane import find_library
from attnd.wire import encode_layer

from attnd_process import start, stop
from attnd_testlib import Harness, wait_for

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
            # A prefill long enough that the call's 5 ms deadline passes while the server is
            # still at it: the client cannot know what the server did with the call's space.
            step = c.begin_step([(sid, 2048)])
            c._timeout = 0.005
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
