"""The one handoff loop, without I/O: :meth:`AttndClient.handoff` and
:meth:`AsyncAttndClient.handoff` drive it, each with its own calls (sync or awaited).

:func:`handoff_plan` is a generator of operations; :func:`drive` performs each one and sends
its result back (or throws its error in); a sync client runs it with ``run_sync``
(``attnd/sync.py``). The plan opens the copy as a handoff target at the source's generation,
begins a write-only step at each exported chunk's layer 0, sends every layer, checks what the
receiver holds, and on any failure aborts the open step there and closes the partial copy
(``("cleanup", ...)`` operations, whose own errors the driver ignores). The C++ form of this loop
is ``client/sequence_import.h``.
"""

from __future__ import annotations

from typing import Any, Generator, Tuple

import grpc

from .errors import AttndError
from .types import SequenceInfo
from .v1 import attention_pb2 as pb

# ("open", kwargs) · ("next_chunk",) -> ExportChunk or None · ("begin", batch, block hashes) ->
# BeginStep reply ·
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
            if chunk.keys.layer == 0:  # with its blocks' hashes, for the prefix cache
                step = yield ("begin", [(sequence_id, chunk.tokens)], list(chunk.block_hashes))
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


async def drive(plan: Generator[Operation, Any, SequenceInfo], perform) -> SequenceInfo:
    """Runs ``plan``: ``await perform(op)`` for each operation, its result (or error) back into
    the plan; a cleanup's own AttndError is dropped (the first error is the one raised)."""
    op = next(plan)
    while True:
        try:
            try:
                result = await perform(op)
            except AttndError:
                if op[0] != "cleanup":
                    raise
                result = None
        except BaseException as e:  # into the plan: it cleans up and raises it again
            op = plan.throw(e)
        else:
            try:
                op = plan.send(result)
            except StopIteration as stop:
                return stop.value


def handoff_call(op: Operation, sender, receiver, sequence_id: str):
    """The client call that performs ``op`` (any but ``"next_chunk"``, which reads the driver's
    export stream); on an async client, the coroutine to await."""
    kind = op[0]
    if kind == "open":
        return receiver.open_sequence(sequence_id, **op[1])
    if kind == "begin":
        return receiver.begin_step(op[1], write_only=True,
                                   block_hashes=[op[2]] if op[2] else None)
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
