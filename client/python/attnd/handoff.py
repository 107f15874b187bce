"""The one handoff loop, without I/O: :meth:`AttndClient.handoff` and
:meth:`AsyncAttndClient.handoff` drive it, each with its own calls (sync or awaited).

:func:`handoff_plan` is a generator of operations; the driver performs each one and sends its
result back (or throws its error in). It opens the copy as a handoff target at the source's
generation, begins a write-only step at each exported chunk's layer 0, sends every layer, checks
what the receiver holds, and on any failure aborts the open step there and closes the partial
copy (``("cleanup", ...)`` operations, whose own errors the driver ignores). The C++ form of this
loop is ``client/sequence_import.h``.
"""

from __future__ import annotations

from typing import Any, Generator, Tuple

import grpc

from .errors import AttndError
from .types import SequenceInfo
from .v1 import attention_pb2 as pb

# ("open", kwargs) · ("next_chunk",) -> ExportChunk or None · ("begin", batch) -> BeginStep reply ·
# ("layer", AttendLayerRequest) · ("describe", "to" | "from") -> SequenceInfo ·
# ("cleanup", "abort", step_id) · ("cleanup", "close") · ("close_source",)
Operation = Tuple[Any, ...]


def handoff_plan(sequence_id: str, source: SequenceInfo,
                 close_source: bool) -> Generator[Operation, Any, SequenceInfo]:
    """The operations of one handoff of ``sequence_id`` (``source``: its info on the sender);
    returns the receiver's info once the copy is confirmed."""
    length = source.length
    yield ("open", {"import_length": length, "import_generation": source.generation})
    step = None
    try:
        while True:
            chunk = yield ("next_chunk",)
            if chunk is None:
                break
            if chunk.keys.layer == 0:
                step = yield ("begin", [(sequence_id, chunk.tokens)])
            elif step is None:
                raise AttndError(grpc.StatusCode.INTERNAL,
                                 f"handoff: a chunk began at layer {chunk.keys.layer}, not 0")
            yield ("layer", pb.AttendLayerRequest(step_id=step.step_id, inputs=chunk.keys))
        step = None
        there = yield ("describe", "to")
        if there.length != length or there.importing:
            raise AttndError(grpc.StatusCode.INTERNAL,
                             f"handoff: the receiver holds {there.length} of {length} tokens")
        if there.generation != source.generation:  # an older attnd drops import_generation
            raise AttndError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"handoff: the receiver holds it at generation "
                             f"{there.generation}, not {source.generation}")
        if close_source and (yield ("describe", "from")).length != length:
            raise AttndError(grpc.StatusCode.ABORTED,
                             f"handoff: {sequence_id!r} grew on the source during the copy")
    except BaseException:
        # A sequence in a step cannot be closed: the receiver's open step goes first.
        if step is not None:
            yield ("cleanup", "abort", step.step_id)
        yield ("cleanup", "close")
        raise
    if close_source:
        yield ("close_source",)
    return there


class HandoffDriver:
    """Steps a :func:`handoff_plan` by results and errors (the same for both drivers): ``first``
    gives the first operation, ``done(result)`` or ``failed(error)`` the next one; ``finished``
    and ``value`` once the plan returned."""

    def __init__(self, plan: Generator[Operation, Any, SequenceInfo]):
        self._plan = plan
        self.finished = False
        self.value = None

    def first(self) -> Operation:
        return next(self._plan)

    def done(self, result: Any) -> Operation:
        return self._advance(lambda: self._plan.send(result))

    def failed(self, op: Operation, error: BaseException) -> Operation:
        if op[0] == "cleanup" and isinstance(error, AttndError):
            return self.done(None)  # best effort: the first error is the one raised
        return self._advance(lambda: self._plan.throw(error))

    def _advance(self, step) -> Operation:
        try:
            return step()
        except StopIteration as stop:
            self.finished = True
            self.value = stop.value
            return ("finished",)


def handoff_call(op: Operation, sender, receiver, sequence_id: str):
    """The client call that performs ``op`` (any but ``"next_chunk"``, which reads the driver's
    export stream); on an async client, the coroutine to await."""
    kind = op[0]
    if kind == "open":
        return receiver.open_sequence(sequence_id, **op[1])
    if kind == "begin":
        return receiver.begin_step(op[1], write_only=True)
    if kind == "layer":
        return receiver._unary("AttendLayer", op[1])
    if kind == "describe":
        return (receiver if op[1] == "to" else sender).describe_sequence(sequence_id)
    if kind == "cleanup":
        if op[1] == "abort":
            return receiver.abort_step(op[2])
        return receiver.close_sequence(sequence_id)
    if kind == "close_source":
        return sender.close_sequence(sequence_id)
    raise ValueError(f"handoff: unknown operation {op!r}")
