"""Merging what several servers computed over disjoint parts of one sequence (context
parallelism, docs/numerics.md): :func:`merge_candidates` and :func:`merge_attention`."""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

from .tensors import as_numpy
from .types import Candidates

__all__ = ["merge_attention", "merge_candidates"]


def merge_candidates(parts: Sequence[Candidates]) -> Candidates:
    """Every server's candidates for one layer merged: per query all of them, best first (score
    descending, ties to the lower key), the first ``keep``: the global selection's candidates."""
    if not parts:
        raise ValueError("merge_candidates: no parts")
    first = parts[0]
    for p in parts:
        if len(p.count) != len(first.count) or p.keep != first.keep or p.pages != first.pages:
            raise ValueError("merge_candidates: the parts disagree on the queries, the keys' kind "
                             "or how many to keep")
        if int(p.count.sum()) != len(p.keys) or len(p.keys) != len(p.scores):
            raise ValueError("merge_candidates: counts, keys and scores disagree")
    starts = [np.concatenate([[0], np.cumsum(p.count)]) for p in parts]
    count, keys, scores = [], [], []
    for t in range(len(first.count)):
        k = np.concatenate([p.keys[s[t]:s[t + 1]] for p, s in zip(parts, starts)])
        v = np.concatenate([p.scores[s[t]:s[t + 1]] for p, s in zip(parts, starts)])
        order = np.lexsort((k, -v.astype(np.float64)))[:first.keep]
        count.append(len(order))
        keys.append(k[order])
        scores.append(v[order])
    return Candidates(pages=first.pages, keep=first.keep, count=np.array(count, np.int32),
                      keys=np.concatenate(keys).astype(np.int64) if keys else np.zeros(0, np.int64),
                      scores=(np.concatenate(scores).astype(np.float32) if scores
                              else np.zeros(0, np.float32)))


def merge_attention(outs: Sequence, lses: Sequence) -> Tuple[np.ndarray, np.ndarray]:
    """Merges attention outputs computed over disjoint key sets (a sequence split over servers):
    ``outs[i]`` [T, H, L] and ``lses[i]`` [T, H] (``LayerResult.lse``). Returns (out, lse) in
    float32: out = sum_i exp(lse_i - lse) out_i with lse = log sum_i exp(lse_i), computed in
    float64. Parts whose lse is -inf (they saw no key) add nothing; a query head that no part saw
    gets out 0 and lse -inf, as one server attending nothing reports; a NaN lse makes its row
    NaN."""
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"merge_attention: {len(outs)} outputs and {len(lses)} lse arrays; "
                         "give one lse per output, at least one")
    o = [np.asarray(as_numpy(x), dtype=np.float64) for x in outs]
    e = [np.asarray(as_numpy(x), dtype=np.float64) for x in lses]
    for i, (oi, ei) in enumerate(zip(o, e)):
        if oi.ndim != 3 or ei.shape != oi.shape[:2] or oi.shape != o[0].shape:
            raise ValueError(f"merge_attention: part {i} has out {list(oi.shape)} and lse "
                             f"{list(ei.shape)}; every out must be [T, H, L] with lse [T, H]")
    stacked = np.stack(e)  # [P, T, H]
    nan = np.isnan(stacked).any(axis=0)  # a NaN part makes its row NaN, as in MergeAttention
    clean = np.where(np.isnan(stacked), -np.inf, stacked)
    top = clean.max(axis=0)
    safe = np.where(np.isneginf(top), 0.0, top)
    w = np.exp(clean - safe)  # exp(-inf) = 0: parts that saw nothing
    denom = w.sum(axis=0)
    # Parts of weight 0 add nothing, whatever their output holds.
    out = sum(np.where(wi[..., None] > 0, wi[..., None] * oi, 0.0) for wi, oi in zip(w, o))
    seen = denom > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(seen[..., None], out / np.where(seen, denom, 1.0)[..., None], 0.0)
        lse = np.where(seen, safe + np.log(np.where(seen, denom, 1.0)), -np.inf)
    out[nan] = np.nan
    lse[nan] = np.nan
    return out.astype(np.float32), lse.astype(np.float32)
