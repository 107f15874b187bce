"""Context parallelism (docs/numerics.md): one logical sequence spread over several attnd servers,
each holding a contiguous, page-aligned slice of its positions.

The client drives each server's step and merges what comes back: a full layer first gathers
every server's candidates (``attend_layer_candidates``), merges them into the global
selection (:func:`merge_candidates`) and sends it with the queries (one extra round trip per
full layer); every layer's partial outputs merge by log-sum-exp (:func:`merge_attention`). The
result equals one server holding the whole sequence.

    seq = ContextParallelSequence([a, b], [0, 32768], "req-1")   # a: [0, 32K), b: the rest
    seq.open()
    results = seq.step(T, layers)   # layers[l]: dict of layer l's tensors, as for one server
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from .client import AttndClient
from .merge import merge_attention, merge_candidates
from .types import Candidates
from .v1 import attention_pb2 as pb
from .wire import LayerInputs, decode_layer, encode_layer

_KEYS = ("kv_latent", "k_rope", "index_k")
_QUERIES = ("q_latent", "q_nope", "q_rope")
_INDEX_QUERIES = ("index_q", "index_w")


@dataclasses.dataclass(frozen=True)
class MergedLayer:
    """One layer of a context-parallel step, merged over the servers."""

    out: np.ndarray  # [T, H, W] float32
    lse: np.ndarray  # [T, H] float32
    attended: Optional[List[np.ndarray]]  # [T] absolute key positions, when asked


class ContextParallelSequence:
    """A sequence over ``clients`` (in position order): client i holds positions
    [starts[i], starts[i + 1]), the last one every position from its start on. starts[0] is 0;
    each start a multiple of the model's page size, ascending."""

    def __init__(self, clients: Sequence[AttndClient], starts: Sequence[int],
                 sequence_id: str) -> None:
        starts = [int(s) for s in starts]
        if (not clients or len(clients) != len(starts) or starts[0] != 0 or
                any(b <= a for a, b in zip(starts, starts[1:]))):
            raise ValueError("ContextParallelSequence: one start per client, the first 0, "
                             "strictly ascending")
        self.clients = list(clients)
        self.starts = starts
        self.sequence_id = sequence_id
        self.length = 0
        self.candidates_seconds = 0.0  # the last step's time in candidates round trips
        self._pool = concurrent.futures.ThreadPoolExecutor(len(self.clients))

    def open(self) -> None:
        """Checks that every server serves context parallelism (``info().context_parallel``: an
        older attnd would ignore the fields and write an attend-only step's tokens) and the same
        model, with the starts on its pages; then opens the (empty) sequence on every server; on
        failure closes what it opened."""
        models = []
        for k, c in enumerate(self.clients):
            info = c.info()
            if not info.context_parallel:
                raise ValueError(f"context parallelism: server {k} ({info.version}) does not serve "
                                 "it (an older attnd, or a model with a sliding window)")
            models.append(info.model)
            if self.starts[k] % info.model.page_size:
                raise ValueError(f"context parallelism: start {self.starts[k]} is not a multiple "
                                 f"of the page size {info.model.page_size}")
        if any(m != models[0] for m in models):
            raise ValueError("context parallelism: the servers serve different models")
        opened = []
        try:
            for c in self.clients:
                c.open_sequence(self.sequence_id)
                opened.append(c)
        except Exception:
            for c in opened:
                c.close_sequence(self.sequence_id)
            raise

    def close(self) -> None:
        """Closes it on every server (raises the first error after trying all)."""
        first = None
        for c in self.clients:
            try:
                c.close_sequence(self.sequence_id)
            except Exception as e:  # noqa: BLE001 - every server is tried
                first = first or e
        self._pool.shutdown(wait=False)
        if first is not None:
            raise first

    def step(self, q_len: int, layers: Sequence[Dict[str, np.ndarray]],
             attended: bool = False) -> List[MergedLayer]:
        """One step of ``q_len`` new tokens at the sequence's end: ``layers[l]`` holds layer l's
        tensors for the whole step as one server takes them. The tokens must lie in one server's
        slice (split a chunk at a boundary into two steps). On any error every server's step is
        aborted: the sequence stays as it was."""
        begin, end = self.length, self.length + int(q_len)
        tail = 0
        while tail + 1 < len(self.starts) and begin >= self.starts[tail + 1]:
            tail += 1
        if tail + 1 < len(self.starts) and end > self.starts[tail + 1]:
            raise ValueError(f"context parallelism: tokens [{begin}, {end}) cross the slice "
                             f"boundary at {self.starts[tail + 1]}; split the chunk there")
        servers = self.clients[:tail + 1]
        steps = []
        try:
            for k, c in enumerate(servers):
                attend_only = k < tail
                steps.append(c.begin_step(
                    [(self.sequence_id, q_len)], position_offsets=[self.starts[k]],
                    query_positions=[begin] if attend_only else None).step_id)
            self.candidates_seconds = 0.0
            results = [self._layer(servers, steps, tail, layer, tensors, attended)
                       for layer, tensors in enumerate(layers)]
        except Exception:
            for c, s in zip(servers, steps):
                try:
                    c.abort_step(s)
                except Exception:  # noqa: BLE001 - a committed or already aborted step
                    pass
            raise
        self.length = end
        return results

    def _each(self, fn, n):
        return [f.result() for f in [self._pool.submit(fn, k) for k in range(n)]]

    def _layer(self, servers, steps, tail, layer, tensors, attended) -> MergedLayer:
        full = tensors.get("index_q") is not None
        n = len(servers)

        def pick(k, names):
            return {name: tensors.get(name) for name in names}

        selection: Optional[Candidates] = None
        if full:
            t0 = time.perf_counter()
            parts = self._each(lambda k: servers[k].attend_layer_candidates(
                steps[k],
                LayerInputs(layer, **pick(k, _INDEX_QUERIES + (_KEYS if k == tail else ())))), n)
            self.candidates_seconds += time.perf_counter() - t0
            selection = merge_candidates(parts)
        keys = () if full else _KEYS

        def attend(k):  # attend_layer_details, but with no keys where this server writes none
            c = servers[k]
            inputs = LayerInputs(layer, **pick(k, _QUERIES + (keys if k == tail else ())),
                                 return_attended=attended, return_lse=True, out_datatype="FP32",
                                 selection=selection)
            msg = encode_layer(inputs, uint16_as_bf16=False, keys_required=False)
            return c._unary("AttendLayer", pb.AttendLayerRequest(step_id=steps[k], inputs=msg),
                            lambda r: decode_layer(r.output, inputs, False, "details"))

        replies = self._each(attend, n)
        out, lse = merge_attention([r.out for r in replies], [r.lse for r in replies])
        keys_seen = None
        if attended:
            T = out.shape[0]
            keys_seen = [np.sort(np.concatenate([r.attended[t] for r in replies]))
                         for t in range(T)]
        return MergedLayer(out=out, lse=lse, attended=keys_seen)
