"""Helpers the client tests share (not a test module: no tests here, and test modules import
nothing from each other, only from here, attnd_process and their conftest fixtures).

- a float64 reference of the attention contract and a harness keeping sequences in step with it
  (:class:`Reference`, :class:`Harness`), and S-shard steps (:func:`run_sharded`);
- random layer tensors (:func:`random_layer`, :func:`bf16_layers`, :func:`fp32_keys`,
  :func:`fp32_queries`) and whole steps (:func:`run_step`, :func:`write_keys`,
  :func:`decode_with_lse`) with their float64 answers (:func:`reference_attention`).
"""

from __future__ import annotations

import queue
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import grpc
import ml_dtypes
import numpy as np
import pytest

from attnd import AttndClient, AttndError, LayerInputs, ModelSpec, ServerInfo, StepStream

from attnd_process import free_port  # noqa: F401  (re-exported for conftest)

Batch = List[Tuple[str, int]]
#: One layer's tensors by LayerInputs field name (``LayerInputs(layer, **tensors)``).
LayerTensors = Dict[str, np.ndarray]


BF16 = np.dtype(ml_dtypes.bfloat16)


def f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float32).astype(np.float64)  # exact for bf16, fp16 and fp32


class Reference:
    """The contract in float64: per sequence and layer the stored latent rows [c_kv | k_pe] and
    (full
    layers) indexer keys, rounded like the server's cache."""

    def __init__(self, spec: ModelSpec, cache_datatype: str) -> None:
        self.spec = spec
        self.cache_dtype = BF16 if cache_datatype == "BF16" else np.dtype(np.float32)
        self.seqs: Dict[str, List[Dict[str, np.ndarray]]] = {}
        # diagnostics: the smallest non-zero relative top-k boundary gap, and exact boundary ties
        self.min_margin = np.inf
        self.boundary_ties = 0
        # per layer of the last step: each query's attended key positions (ascending)
        self.last_attended: List[List[np.ndarray]] = []

    def cache(self, a: np.ndarray) -> np.ndarray:
        """New keys as stored: wire -> fp32 -> cache dtype (round to nearest even) -> float64."""
        return np.asarray(a).astype(np.float32).astype(self.cache_dtype).astype(np.float64)

    def open(self, sid: str, parent: Optional[str] = None, prefix_len: int = 0) -> None:
        s = self.spec
        if parent is None:
            self.seqs[sid] = [
                {"ckv": np.zeros((0, s.kv_lora_rank)), "kpe": np.zeros((0, s.qk_rope_head_dim)),
                 "ik": np.zeros((0, s.index_head_dim))}
                for _ in s.layers
            ]
        else:
            assert prefix_len <= self.length(parent)
            self.seqs[sid] = [{k: v[:prefix_len].copy() for k, v in layer.items()}
                              for layer in self.seqs[parent]]

    def close(self, sid: str) -> None:
        del self.seqs[sid]

    def length(self, sid: str) -> int:
        return self.seqs[sid][0]["ckv"].shape[0]

    def _select(self, iq: np.ndarray, w: np.ndarray, ik: np.ndarray, pos: int) -> np.ndarray:
        """Exact top-k of I[s] = sum_h w[h] relu(iq[h] . ik[s]) over s <= pos; ties to lower s."""
        K = self.spec.index_topk
        visible = pos + 1
        if visible <= K:
            return np.arange(visible)
        scores = (np.maximum(iq @ ik[:visible].T, 0.0) * w[:, None]).sum(axis=0)
        order = np.argsort(-scores, kind="stable")  # stable: equal scores keep the lower position
        gap = scores[order[K - 1]] - scores[order[K]]
        if gap == 0:  # an exact tie at the boundary (all-relu-zero scores): decided by position
            self.boundary_ties += 1
        else:
            self.min_margin = min(self.min_margin, gap / max(np.abs(scores).max(), 1e-30))
        return np.sort(order[:K])

    def step(self, batch: Sequence[Tuple[str, int]], inputs: List[LayerTensors]
             ) -> List[np.ndarray]:
        """Expected outputs (float64 [T, H, L]; None on write-only layers) and commits the keys."""
        s = self.spec
        tokens = [(sid, self.length(sid) + j) for sid, q_len in batch for j in range(q_len)]
        T = len(tokens)
        staged: Dict[str, List[Dict[str, np.ndarray]]] = {sid: [] for sid, _ in batch}
        outs: List[Optional[np.ndarray]] = []
        self.last_attended = []
        selection: Optional[List[np.ndarray]] = None
        for layer, kind in enumerate(s.layers):
            x = inputs[layer]
            # 1. write the new keys
            keys: Dict[str, Dict[str, np.ndarray]] = {}
            row = 0
            for sid, q_len in batch:
                old = self.seqs[sid][layer]
                rows = slice(row, row + q_len)
                keys[sid] = {
                    "ckv": np.concatenate([old["ckv"], self.cache(x["kv_latent"][rows])]),
                    "kpe": np.concatenate([old["kpe"], self.cache(x["k_rope"][rows])]),
                    "ik": (np.concatenate([old["ik"], self.cache(x["index_k"][rows])])
                           if kind == "full" else old["ik"]),
                }
                staged[sid].append(keys[sid])
                row += q_len
            if x.get("q_latent") is None:  # write-only step
                outs.append(None)
                continue
            # 2-3. index and select (full), reuse (shared), everything visible (dense)
            if kind == "full":
                iq, iw = f64(x["index_q"]), f64(x["index_w"])
                selection = [self._select(iq[t], iw[t], keys[sid]["ik"], pos)
                             for t, (sid, pos) in enumerate(tokens)]
                layer_selection = selection
            elif kind == "shared":
                assert selection is not None, "a shared layer before any full layer"
                layer_selection = selection
            else:
                layer_selection = [np.arange(pos + 1) for _, pos in tokens]
            self.last_attended.append(layer_selection)
            # 4. attend
            ql, qr = f64(x["q_latent"]), f64(x["q_rope"])
            out = np.zeros((T, s.num_heads, s.kv_lora_rank))
            for t, (sid, _) in enumerate(tokens):
                sel = layer_selection[t]
                ckv, kpe = keys[sid]["ckv"][sel], keys[sid]["kpe"][sel]
                logits = s.sm_scale * (ql[t] @ ckv.T + qr[t] @ kpe.T)  # [H, n]
                p = np.exp(logits - logits.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                out[t] = p @ ckv
            outs.append(out)
        for sid, layers in staged.items():
            self.seqs[sid] = layers
        return outs


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(f64(got) - want) / np.linalg.norm(want))


class Harness:
    def __init__(self, client: AttndClient, info: ServerInfo, seed: int, tag: str) -> None:
        self.client = client
        self.info = info
        self.spec = info.model
        self.ref = Reference(info.model, info.cache_datatype)
        self.rng = np.random.default_rng(seed)
        self.tag = tag
        self.opened: List[str] = []

    # sequences (server and reference together)

    def open(self, name: str, parent: Optional[str] = None, prefix_len: int = 0) -> str:
        sid = f"{self.tag}-{name}"
        got = self.client.open_sequence(sid, fork_parent=parent, prefix_len=prefix_len)
        assert got.sequence_id == sid and got.length == prefix_len and not got.in_step, got
        self.ref.open(sid, parent, prefix_len)
        self.opened.append(sid)
        return sid

    def close_all(self) -> None:
        for sid in self.opened:
            try:
                self.client.close_sequence(sid)
            except AttndError:
                pass

    def states(self, sids: Sequence[str]) -> Dict[str, Tuple[int, bool]]:
        """(length, in_step) of each sequence, from the server."""
        out = {}
        for sid in sids:
            d = self.client.describe_sequence(sid)
            out[sid] = (d.length, d.in_step)
        return out

    def assert_unchanged(self, sids: Sequence[str]) -> None:
        """The server's sequences are as the reference has them: committed length, not in a step."""
        for sid, (length, in_step) in self.states(sids).items():
            assert (length, in_step) == (self.ref.length(sid), False), sid

    # data

    def rand(self, shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        x = self.rng.standard_normal(shape).astype(np.float32)
        x = np.where(np.abs(x) < 1e-2, np.float32(1e-2), x)  # random, never (near) zero
        return x.astype(dtype)

    def inputs(self, T: int, dtype: np.dtype = BF16, write_only: bool = False
               ) -> List[LayerTensors]:
        s = self.spec
        layers = []
        for kind in s.layers:
            x: LayerTensors = {
                "kv_latent": self.rand((T, s.kv_lora_rank), dtype),
                "k_rope": self.rand((T, s.qk_rope_head_dim), dtype),
            }
            if not write_only:
                x["q_latent"] = self.rand((T, s.num_heads, s.kv_lora_rank), dtype)
                x["q_rope"] = self.rand((T, s.num_heads, s.qk_rope_head_dim), dtype)
            if kind == "full":
                x["index_k"] = self.rand((T, s.index_head_dim), dtype)
                if not write_only:
                    x["index_q"] = self.rand((T, s.index_n_heads, s.index_head_dim), dtype)
                    x["index_w"] = self.rand((T, s.index_n_heads), dtype)
            layers.append(x)
        return layers

    # steps

    def send(self, via, batch: Batch, inputs: List[LayerTensors], write_only: bool = False
             ) -> List[Optional[np.ndarray]]:
        """Runs a whole step on the server through a StepStream or the unary calls of a client."""
        T = sum(q for _, q in batch)
        if isinstance(via, StepStream):
            step = via.begin(batch, write_only=write_only)
            outs = [via.layer(LayerInputs(i, **x)) for i, x in enumerate(inputs)]
            assert via.step is None  # committed
        else:
            step = via.begin_step(batch, write_only=write_only)
            outs = [via.attend_layer(step.step_id, LayerInputs(i, **x))
                    for i, x in enumerate(inputs)]
        assert step.num_tokens == T
        return outs

    def step(self, via, batch: Batch, dtype: np.dtype = BF16, tol: float = 1e-2,
             inputs: Optional[List[LayerTensors]] = None, what: str = "") -> List[np.ndarray]:
        """Runs a step on the server and checks every layer's output against the reference."""
        T = sum(q for _, q in batch)
        inputs = inputs if inputs is not None else self.inputs(T, dtype)
        outs = self.send(via, batch, inputs)
        want = self.ref.step(batch, inputs)
        self.check(outs, want, inputs, f"{what} batch {batch}", tol)
        return outs

    def check(self, outs, want, inputs, what: str, tol: float) -> None:
        s = self.spec
        for layer, (got, exp) in enumerate(zip(outs, want)):
            dtype = inputs[layer]["q_latent"].dtype
            assert got is not None and got.dtype == dtype, (what, layer, got)
            assert got.shape == (exp.shape[0], s.num_heads, s.kv_lora_rank), (what, layer,
                                                                              got.shape)
            assert np.isfinite(f64(got)).all(), f"{what} layer {layer}: NaN/inf in the output"
            err = rel_l2(got, exp)
            assert err <= tol, (f"{what} layer {layer} ({s.layers[layer]}): relative L2 "
                                f"{err:.3g} > {tol} (top-k boundary: min relative gap "
                                f"{self.ref.min_margin:.3g}, "
                                f"{self.ref.boundary_ties} exact ties)")

    def assert_serves(self, sids: Sequence[str]) -> None:
        """The server still answers and a decode step over ``sids`` matches the reference."""
        assert self.client.info().model == self.spec
        self.step(self.client, [(sid, 1) for sid in sids], what="after error:")
        self.assert_unchanged(sids)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


def first_full_layer(spec: ModelSpec, at_least: int = 0) -> int:
    full = [i for i, k in enumerate(spec.layers) if k == "full" and i >= at_least]
    return full[0] if full else [i for i, k in enumerate(spec.layers) if k == "full"][0]


def expect(code: grpc.StatusCode, call, *args, **kwargs) -> AttndError:
    with pytest.raises(AttndError) as e:
        call(*args, **kwargs)
    assert e.value.code == code, f"expected {code.name}, got {e.value.code.name}: {e.value.details}"
    return e.value


def socket_path(port: int) -> str:
    """The Unix-socket listener of the session server on ``port`` (shared memory goes there)."""
    return f"/tmp/attnd-pytest-{port}.sock"


def local_target(target: str) -> str:
    """The gRPC target of the Unix-socket listener of the session server at ``target``."""
    return "unix:" + socket_path(int(target.rsplit(":", 1)[1]))


# ---- sharded steps -------------------------------------------------------------------------------


SHARD_TIMEOUT_S = 60.0


def shard_inputs(x: LayerTensors, S: int, k: int) -> LayerTensors:
    """Shard k's message of a layer: its heads of q_latent / q_rope; shard 0 also the keys and the
    indexer tensors."""
    H = x["q_latent"].shape[1]
    heads = slice(k * H // S, (k + 1) * H // S)
    part = {"q_latent": x["q_latent"][:, heads], "q_rope": x["q_rope"][:, heads]}
    if k == 0:
        part.update({n: v for n, v in x.items() if n not in part})
    return part


def run_sharded(vias: Sequence, batch: Batch, inputs: List[LayerTensors], S: int,
                layer_kwargs=None, details: bool = False) -> List[List[np.ndarray]]:
    """One step run by S shards, each in its own thread: vias[k] is shard k's StepStream (shard 0
    begins, the others join) or an AttndClient (unary; shard 0 begins). Returns outs[layer][shard]
    (with ``details``: through the details calls, each a LayerResult).

    ``layer_kwargs(k, layer, msg)`` may rewrite shard k's LayerInputs fields for a layer."""
    T = sum(q for _, q in batch)
    step_ids: List[queue.Queue[Optional[int]]] = [queue.Queue() for _ in range(S)]

    def shard(k: int) -> List[np.ndarray]:
        via = vias[k]
        stream = isinstance(via, StepStream)
        if k == 0:
            step_id = None
            try:
                begin = via.begin if stream else via.begin_step
                step = begin(batch, num_shards=S)
                assert step.num_tokens == T
                step_id = step.step_id
            finally:
                for q in step_ids[1:]:
                    q.put(step_id)  # None: the others give up
        else:
            step_id = step_ids[k].get(timeout=SHARD_TIMEOUT_S)
            if step_id is None:
                raise RuntimeError(f"shard {k}: shard 0 did not open the step")
            if stream:
                joined = via.join(step_id, k)
                assert (joined.step_id, joined.num_tokens) == (step_id, T)
                assert via.shard == k
        outs = []
        for i, x in enumerate(inputs):
            msg = shard_inputs(x, S, k)
            if layer_kwargs is not None:
                msg = layer_kwargs(k, i, msg)
            if stream:  # the shard defaults to the joined one
                inputs_k = LayerInputs(i, **msg)
                outs.append(via.layer_details(inputs_k) if details else via.layer(inputs_k))
            else:
                inputs_k = LayerInputs(i, shard=k, **msg)
                outs.append(via.attend_layer_details(step_id, inputs_k) if details
                            else via.attend_layer(step_id, inputs_k))
        if stream:
            assert via.step is None  # committed
        return outs

    with ThreadPoolExecutor(max_workers=S) as pool:
        futures = [pool.submit(shard, k) for k in range(S)]
        per_shard = [f.result(timeout=SHARD_TIMEOUT_S) for f in futures]
    return [list(layer) for layer in zip(*per_shard)]


# ---- random layers and whole steps ---------------------------------------------------------------


def random_layer(spec, kind, T, rng, q_nope_dim=None):
    """One layer call's tensors for T tokens: the query (q_latent, or q_nope [T, H, q_nope_dim]
    for server-side absorption), q_rope, the new keys and, on full layers, the indexer's."""
    x = {"q_nope" if q_nope_dim else "q_latent":
         rng.standard_normal((T, spec.num_heads, q_nope_dim or spec.kv_lora_rank)),
         "q_rope": rng.standard_normal((T, spec.num_heads, spec.qk_rope_head_dim)),
         "kv_latent": rng.standard_normal((T, spec.kv_lora_rank)),
         "k_rope": rng.standard_normal((T, spec.qk_rope_head_dim))}
    if kind == "full":
        x["index_q"] = rng.standard_normal((T, spec.index_n_heads, spec.index_head_dim))
        x["index_k"] = rng.standard_normal((T, spec.index_head_dim))
        x["index_w"] = rng.standard_normal((T, spec.index_n_heads))
    return {k: v.astype(np.float32) for k, v in x.items()}


def bf16_layers(spec, T, rng, write_only=False):
    layers = []
    r = lambda *shape: rng.standard_normal(shape).astype(BF16)  # noqa: E731
    for kind in spec.layers:
        x = {"kv_latent": r(T, spec.kv_lora_rank), "k_rope": r(T, spec.qk_rope_head_dim)}
        if not write_only:
            x["q_latent"] = r(T, spec.num_heads, spec.kv_lora_rank)
            x["q_rope"] = r(T, spec.num_heads, spec.qk_rope_head_dim)
        if kind == "full":
            x["index_k"] = r(T, spec.index_head_dim)
            if not write_only:
                x["index_q"] = r(T, spec.index_n_heads, spec.index_head_dim)
                x["index_w"] = r(T, spec.index_n_heads)
        layers.append(x)
    return layers


def run_step(client, sid, inputs):
    step = client.begin_step([(sid, inputs[0]["kv_latent"].shape[0])])
    return [client.attend_layer(step.step_id, LayerInputs(i, **x)) for i, x in enumerate(inputs)]


def fp32_keys(spec, T, rng):
    """Per layer: the new keys of T tokens (fp32, scaled so that scores spread widely)."""
    out = []
    for kind in spec.layers:
        x = {"kv_latent": rng.standard_normal((T, spec.kv_lora_rank)).astype(np.float32),
             "k_rope": rng.standard_normal((T, spec.qk_rope_head_dim)).astype(np.float32)}
        if kind == "full":
            x["index_k"] = rng.standard_normal((T, spec.index_head_dim)).astype(np.float32)
        out.append(x)
    return out


def fp32_queries(spec, rng):
    """Per layer: one decode token's queries (fp32)."""
    out = []
    for kind in spec.layers:
        x = {"q_latent": 2 * rng.standard_normal((1, spec.num_heads, spec.kv_lora_rank)),
             "q_rope": 2 * rng.standard_normal((1, spec.num_heads, spec.qk_rope_head_dim))}
        if kind == "full":
            x["index_q"] = rng.standard_normal((1, spec.index_n_heads, spec.index_head_dim))
            x["index_w"] = rng.standard_normal((1, spec.index_n_heads))
        out.append({k: v.astype(np.float32) for k, v in x.items()})
    return out


def write_keys(client, sid, keys):
    step = client.begin_step([(sid, keys[0]["kv_latent"].shape[0])], write_only=True)
    for layer, x in enumerate(keys):
        client.attend_layer(step.step_id, LayerInputs(layer, **x))


def decode_with_lse(client, sid, new_key, queries, *, stream=False):
    """One decode step over every layer with lse and the attended positions; [LayerResult]."""
    tensors = [dict(k, **q) for k, q in zip(new_key, queries)]
    if stream:
        with client.stream() as s:
            s.begin([(sid, 1)])
            return [s.layer_details(LayerInputs(layer, return_lse=True, return_attended=True, **x))
                    for layer, x in enumerate(tensors)]
    step = client.begin_step([(sid, 1)])
    return [client.attend_layer_details(step.step_id, LayerInputs(layer, return_lse=True,
                                                                  return_attended=True, **x))
            for layer, x in enumerate(tensors)]


def reference_attention(spec, kind, keys, q):
    """float64 attention of one query over key rows `keys` [n, L+R]: (out [H, L], lse [H])."""
    k = np.asarray(keys, dtype=np.float64)
    qq = np.concatenate([q["q_latent"][0], q["q_rope"][0]], axis=-1).astype(np.float64)
    s = spec.sm_scale * qq @ k.T  # [H, n]
    if kind == "dense" and spec.soft_cap > 0:
        s = spec.soft_cap * np.tanh(s / spec.soft_cap)
    top = s.max(axis=1, keepdims=True)
    p = np.exp(s - top)
    lse = top[:, 0] + np.log(p.sum(axis=1))
    return (p / p.sum(axis=1, keepdims=True)) @ k[:, :spec.kv_lora_rank], lse


def key_rows(keys, new_key, layer):
    """The layer's cached key rows [n + 1, L+R]: the written ones, then the decode token's."""
    rows = np.concatenate([keys[layer]["kv_latent"], keys[layer]["k_rope"]], axis=1)
    new = np.concatenate([new_key[layer]["kv_latent"], new_key[layer]["k_rope"]], axis=1)
    return np.concatenate([rows, new])


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def scrape(mport: int, host: str = "127.0.0.1") -> str:
    """attnd's /metrics text."""
    with urllib.request.urlopen(f"http://{host}:{mport}/metrics", timeout=5) as r:
        return r.read().decode()


def sample(text: str, name: str) -> float:
    """The sum of `name`'s samples in /metrics text `text` (a name with its labels: that sample
    alone); 0 when there are none."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or ("{" not in name and line.startswith(name + "{")))


def layer_inputs(spec, T, rng):
    """Random inputs of every layer of a step of T tokens, each asking for its lse."""
    return [LayerInputs(layer, return_lse=True, **random_layer(spec, kind, T, rng))
            for layer, kind in enumerate(spec.layers)]


def step_details(client, batch, inputs, block_hashes=None):
    """A whole unary step; every layer's LayerResult."""
    step = client.begin_step(batch, block_hashes=block_hashes)
    return [client.attend_layer_details(step.step_id, x) for x in inputs]


def wait_for(predicate, what, timeout_s=10.0):
    """Polls ``predicate`` until it holds; fails with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)
