"""Turns a SchedulerOutput into the flat tensors of one forward pass.

Token order: the decode group first, then prefill chunks. The decode group holds every request
with at most MAX_DECODE_QUERY new tokens (a plain decode; a request verifying k proposals, 1 + k
tokens; a draft model's catch-up), one attention row per query token: the query at position p is
an ordinary one-token decode against keys [0, p] through its request's block table (causal by
construction), so the paged decode kernel reads the cache in place instead of the prefill path's
gather + dense mask. Host-side bookkeeping is done with numpy so a step costs a few vectorised
calls, not a loop per token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.engine.input_buffers import PersistentBlockTables
from tokenmill.engine.interfaces import ScheduledRequest
from tokenmill.engine.request import PLACEHOLDER
from tokenmill.layers.attention import AttentionMetadata, GroupMetadata

# Chunks up to this many query tokens attend row by row in the decode group (each row re-reads its
# request's keys, which at these sizes stay in cache); longer ones are prefills (one dense pass). A
# verification of up to 15 proposals is decode rows, which sum in the order a plain decode of the same
# row does: greedy output with speculation stays token for token that of plain decoding (the prefill
# kernel's order differs, and a near-tie could flip).
MAX_DECODE_QUERY = 16


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [R] flat indices of the rows to sample: the last token of each request,
    # or its last 1 + k tokens when it verifies k proposals
    sampled: list[ScheduledRequest]  # the requests sampled, in the same order (request i owns num_sample_rows rows)
    prompt_logprob_offsets: list[tuple[ScheduledRequest, int]]  # requests wanting prompt logprobs, flat start
    every_row_sampled: bool = False  # sample_indices is arange(T): the hidden rows need no gather
    graph_key: tuple[int, int] | None = None  # staged in a CUDA graph's static buffers (engine/cuda_graphs.py):
    # replay that graph instead of running the model
    # (flat row, request id) of each input token that is a PLACEHOLDER: the request's token from the step
    # still running when this one was built (asynchronous scheduling), filled in before the forward.
    pending_rows: list[tuple[int, str]] = field(default_factory=list)


@dataclass(slots=True)
class _Tables:
    """Block tables of some requests: row `rows[i]` of `table` holds request i's block ids (zero padded)."""

    table: np.ndarray
    rows: np.ndarray

    @classmethod
    def rebuilt(cls, group: list[ScheduledRequest]) -> _Tables:
        return cls(_block_table(group), np.arange(len(group)))

    def part(self, start: int, stop: int) -> _Tables:
        return _Tables(self.table, self.rows[start:stop])

    def dense(self, width: int) -> np.ndarray:
        """[len(rows), width], contiguous (attention reads it through a flat view)."""
        return np.ascontiguousarray(self.table[self.rows, :width])


def build_model_input(scheduled: list[ScheduledRequest], block_size: int, sliding_window: int | None,
                      device: torch.device, tables: PersistentBlockTables | None = None,
                      decode_mask: bool = True) -> ModelInput:
    """`tables`: the runner's persistent block tables (None: rebuilt from the block lists, the old
    path). `decode_mask` False: the decode group is served by the paged decode kernel, which needs
    no dense mask (it walks each row's keys up to seq_lens)."""
    if tables is not None and not decode_mask and is_plain_decode(scheduled):
        return _plain_decodes(scheduled, block_size, device, tables)
    decodes = [s for s in scheduled if s.num_new_tokens <= MAX_DECODE_QUERY]
    prefills = [s for s in scheduled if s.num_new_tokens > MAX_DECODE_QUERY]
    ordered = decodes + prefills
    if tables is not None:
        rows = tables.rows_for(ordered)  # first: it may grow (replace) the table
        persistent = _Tables(tables.table, rows)
        all_rows, decode_rows = persistent, persistent.part(0, len(decodes))
        prefill_rows = persistent.part(len(decodes), len(ordered))
    else:  # as before: one table per use, from the lists
        all_rows = _Tables.rebuilt(ordered)
        decode_rows = _Tables.rebuilt(decodes) if decodes else all_rows
        prefill_rows = _Tables.rebuilt(prefills) if prefills else all_rows
    starts = np.array([s.num_computed_tokens for s in ordered], dtype=np.int64)
    lens = np.array([s.num_new_tokens for s in ordered], dtype=np.int64)
    positions = _positions(starts, lens)
    input_ids = np.concatenate([np.asarray(_query_tokens(s), dtype=np.int64) for s in ordered])
    slots = _slots(all_rows, lens, positions, block_size)
    ends = np.cumsum(lens)
    sampled_idx = [i for i, s in enumerate(ordered) if s.needs_sample]
    sample_rows = _sample_rows(ordered, sampled_idx, ends)
    pending = _pending_rows(input_ids, lambda row: ordered[int(np.searchsorted(ends, row, side="right"))])
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        decode=_decode_group(decodes, decode_rows, block_size, sliding_window, device, decode_mask)
        if decodes else None,
        prefill=_group(prefills, prefill_rows, sum(s.num_new_tokens for s in decodes), block_size, sliding_window,
                       device) if prefills else None,
    )
    return ModelInput(
        input_ids=torch.from_numpy(input_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        meta=meta,
        sample_indices=torch.from_numpy(sample_rows).to(device),
        sampled=[ordered[i] for i in sampled_idx],
        prompt_logprob_offsets=[(s, int(ends[i] - lens[i])) for i, s in enumerate(ordered)
                                if s.request.params.prompt_logprobs is not None],
        pending_rows=pending,
    )


def _pending_rows(input_ids: np.ndarray, owner: Callable[[int], ScheduledRequest]) -> list[tuple[int, str]]:
    """(row, request id) of the PLACEHOLDER tokens among `input_ids`; `owner(row)` is the row's request."""
    rows = np.flatnonzero(input_ids == PLACEHOLDER)
    return [(int(r), owner(int(r)).request.request_id) for r in rows]


@dataclass(slots=True)
class PlainDecodeArrays:
    """The host side of a plain decode step (one new token per request, no proposals): what both the
    eager tensors and the CUDA graphs' static buffers (engine/cuda_graphs.py) are filled from."""

    scheduled: list[ScheduledRequest]
    input_ids: np.ndarray  # [n] int64
    positions: np.ndarray  # [n] int64: num_computed_tokens
    slots: np.ndarray  # [n] int64 cache slot of each new token
    seq_lens: np.ndarray  # [n] int64 keys after this step
    table: np.ndarray  # [n, ceil(max seq_len / block_size)] int64, contiguous
    sampled_idx: list[int]  # rows that sample (a plain decode always does, unless a draft model catches up)
    pending_rows: list[tuple[int, str]] = field(default_factory=list)  # as ModelInput's

    @property
    def num_rows(self) -> int:
        return len(self.scheduled)

    def sampling(self, device: torch.device) -> tuple[torch.Tensor, list[ScheduledRequest],
                                                      list[tuple[ScheduledRequest, int]], bool]:
        """sample_indices, sampled, prompt_logprob_offsets, every_row_sampled of the ModelInput."""
        n = self.num_rows
        return (torch.from_numpy(np.array(self.sampled_idx, dtype=np.int64)).to(device),
                [self.scheduled[i] for i in self.sampled_idx],
                [(s, i) for i, s in enumerate(self.scheduled) if s.request.params.prompt_logprobs is not None],
                len(self.sampled_idx) == n)


def is_plain_decode(scheduled: list[ScheduledRequest]) -> bool:
    return bool(scheduled) and all(s.num_new_tokens == 1 and not s.spec_token_ids for s in scheduled)


def plain_decode_arrays(scheduled: list[ScheduledRequest], block_size: int,
                        tables: PersistentBlockTables) -> PlainDecodeArrays:
    """A handful of numpy calls: at batch 1 the general path's ~40 small calls were 0.5 ms of a 10 ms step."""
    n = len(scheduled)
    rows = tables.rows_for(scheduled)
    starts = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, n)
    input_ids = np.fromiter((s.request.token_ids[s.num_computed_tokens] for s in scheduled), np.int64, n)
    seq_lens = starts + 1
    table = tables.table[rows, :-(-int(seq_lens.max()) // block_size)]  # fancy indexing: a contiguous copy
    slots = table[np.arange(n), starts // block_size] * block_size + starts % block_size
    sampled_idx = [i for i, s in enumerate(scheduled) if s.needs_sample]
    return PlainDecodeArrays(scheduled, input_ids, starts, slots, seq_lens, table, sampled_idx,
                             _pending_rows(input_ids, scheduled.__getitem__))


def _plain_decodes(scheduled: list[ScheduledRequest], block_size: int, device: torch.device,
                   tables: PersistentBlockTables) -> ModelInput:
    """The steady state: one new token per request, all on the paged decode kernel (no masks). The
    same tensors as the general path (tests/engine/test_runner_buffers.py checks it against a
    rebuild)."""
    a = plain_decode_arrays(scheduled, block_size, tables)
    n = a.num_rows
    decode = GroupMetadata(block_table=torch.from_numpy(a.table).to(device),
                           seq_lens=torch.from_numpy(a.seq_lens).to(device), mask=None, sliding_mask=None,
                           token_start=0, num_tokens=n, max_query_len=1, pad_index=None)
    sample_indices, sampled, prompt_offsets, every_row = a.sampling(device)
    return ModelInput(
        input_ids=torch.from_numpy(a.input_ids).to(device),
        positions=torch.from_numpy(a.positions).to(device),
        meta=AttentionMetadata(slot_mapping=torch.from_numpy(a.slots).to(device), decode=decode, prefill=None),
        sample_indices=sample_indices,
        sampled=sampled,
        prompt_logprob_offsets=prompt_offsets,
        every_row_sampled=every_row,
        pending_rows=a.pending_rows,
    )


def _sample_rows(ordered: list[ScheduledRequest], sampled_idx: list[int], ends: np.ndarray) -> np.ndarray:
    """Flat indices of the rows each sampled request owns: its last 1 + k tokens."""
    if not any(ordered[i].spec_token_ids for i in sampled_idx):
        return ends[sampled_idx] - 1
    rows = [np.arange(ends[i] - ordered[i].num_sample_rows, ends[i]) for i in sampled_idx]
    return np.concatenate(rows)


def _query_tokens(s: ScheduledRequest) -> list[int]:
    tokens = s.request.token_ids[s.num_computed_tokens:][:s.num_new_tokens]
    return tokens + s.spec_token_ids if s.spec_token_ids else tokens


def _positions(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(start, start + len) for every request, without a Python loop."""
    total = int(lens.sum())
    offsets = np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(starts, lens) + np.arange(total, dtype=np.int64) - offsets


def _slots(tables: _Tables, lens: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    rows = np.repeat(tables.rows, lens)
    return tables.table[rows, positions // block_size] * block_size + positions % block_size


def _block_table(group: list[ScheduledRequest]) -> np.ndarray:
    width = max(len(s.block_ids) for s in group)
    table = np.zeros((len(group), width), dtype=np.int64)
    for i, s in enumerate(group):
        table[i, :len(s.block_ids)] = s.block_ids
    return table


def _decode_group(group: list[ScheduledRequest], tables: _Tables, block_size: int, sliding_window: int | None,
                  device: torch.device, need_mask: bool = True) -> GroupMetadata:
    """One attention row per query token: request i's j-th new token is a one-token decode at
    position num_computed_tokens + j over its request's block table."""
    starts = np.array([s.num_computed_tokens for s in group], dtype=np.int64)
    lens = np.array([s.num_new_tokens for s in group], dtype=np.int64)
    if not (lens > 1).any():
        return _group(group, tables, 0, block_size, sliding_window, device, need_mask)
    positions = _positions(starts, lens)
    seq_lens = positions + 1
    ctx_blocks = -(-int(seq_lens.max()) // block_size)
    table = np.ascontiguousarray(np.repeat(tables.dense(ctx_blocks), lens, axis=0))
    mask = sliding = None
    if need_mask:
        k_pos = np.arange(ctx_blocks * block_size)[None, :]
        q_pos = positions[:, None]
        mask = k_pos <= q_pos  # [R, Lk]
        sliding = None if sliding_window is None else mask & (k_pos > q_pos - sliding_window)
    return GroupMetadata(
        block_table=torch.from_numpy(table).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        mask=None if mask is None else torch.from_numpy(mask[:, None, None]).to(device),
        sliding_mask=None if sliding is None else torch.from_numpy(sliding[:, None, None]).to(device),
        token_start=0,
        num_tokens=int(lens.sum()),
        max_query_len=1,
        pad_index=None,
    )


def _group(group: list[ScheduledRequest], tables: _Tables, token_start: int, block_size: int,
           sliding_window: int | None, device: torch.device, need_mask: bool = True) -> GroupMetadata:
    starts = np.array([s.num_computed_tokens for s in group], dtype=np.int64)[:, None]
    lens = np.array([s.num_new_tokens for s in group], dtype=np.int64)[:, None]
    ctx_blocks = -(-(starts + lens).max() // block_size)
    # Contiguous: a table can be wider than this step's context (blocks held for proposals, or
    # kept after a rollback), and the attention gathers through a flat view of it.
    table = tables.dense(int(ctx_blocks))
    max_q = int(lens.max())
    masks = None
    if need_mask or max_q > 1:  # one query per sequence on the paged decode kernel: no mask
        # Built on first use: a group the native prefill kernel serves never reads it, and at a 2,048-token
        # chunk over 8,192 keys the dense [S, 1, Lq, Lk] mask alone is ~50 ms of numpy.
        masks = functools.partial(_causal_masks, starts, lens, int(ctx_blocks) * block_size, sliding_window, device)
    pad_index = None
    if len(group) > 1 and max_q > 1:
        rows = np.repeat(np.arange(len(group)), lens[:, 0])
        cols = _positions(np.zeros(len(group), dtype=np.int64), lens[:, 0])
        pad_index = torch.from_numpy(rows * max_q + cols).to(device)
    return GroupMetadata(
        block_table=torch.from_numpy(table).to(device),
        seq_lens=torch.from_numpy((starts + lens)[:, 0]).to(device),
        mask=None,
        sliding_mask=None,
        token_start=token_start,
        num_tokens=int(lens.sum()),
        max_query_len=max_q,
        pad_index=pad_index,
        query_lens=torch.from_numpy(lens[:, 0].copy()).to(device),
        build_masks=masks,
    )


def _causal_masks(starts: np.ndarray, lens: np.ndarray, num_keys: int, sliding_window: int | None,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[S, 1, Lq, Lk] masks of a group whose sequence i has lens[i] queries after starts[i] cached keys
    (both [S, 1]): causal, and sliding when a window is given."""
    q_idx = np.arange(int(lens.max()))[None, :, None]  # [1, Lq, 1]
    k_pos = np.arange(num_keys)[None, None, :]  # [1, 1, Lk]
    q_pos = starts[:, :, None] + q_idx  # [S, Lq, 1]
    is_pad = q_idx >= lens[:, :, None]
    # Causal: key j visible to the query at position p iff j <= p. Padding query rows see key 0
    # only, so softmax never meets an all-masked row (their output is discarded).
    mask = (k_pos <= q_pos) & ~is_pad | (is_pad & (k_pos == 0))
    sliding = None if sliding_window is None else mask & ((k_pos > q_pos - sliding_window) | is_pad)
    return (torch.from_numpy(mask[:, None]).to(device),
            None if sliding is None else torch.from_numpy(sliding[:, None]).to(device))
