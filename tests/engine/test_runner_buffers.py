"""The runner's persistent block tables equal a from-scratch rebuild after any history.

Two levels, both property-based:
- `PersistentBlockTables` alone against a model of the KV cache manager's block lists (lists grow
  by appends; a free replaces the list; preemption bumps num_preemptions; ids get reused).
- The real Scheduler + KVCacheManager on a small pool (so preemptions happen) under random adds,
  aborts and finishes: every step's ModelInput built from the persistent tables equals the one
  rebuilt from the block lists, tensor for tensor (slots, block tables, seq lens, masks where the
  rebuilt path has them), and the engine forgets rows exactly as EngineCore does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.config import SchedulerConfig
from tokenmill.engine.input_buffers import PersistentBlockTables
from tokenmill.engine.interfaces import RunnerOutput, SampledTokens, ScheduledRequest
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.model_input import MAX_DECODE_QUERY, ModelInput, build_model_input
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.scheduler import Scheduler
from tokenmill.layers.attention import GroupMetadata

BS = 4
CPU = torch.device("cpu")


def _fake(rid: str, blocks: list[int], preemptions: int, request: Request | None = None) -> ScheduledRequest:
    request = request or Request(rid, [1, 2, 3], SamplingParams())
    request.num_preemptions = preemptions
    return ScheduledRequest(request, 0, 1, blocks)


def _check_rows(tables: PersistentBlockTables, live: dict[str, list[int]]) -> None:
    assert set(tables.rows) <= set(live)
    for rid, row in tables.rows.items():
        blocks = live[rid]
        expected = np.zeros(tables.width, dtype=np.int64)
        expected[:len(blocks)] = blocks
        np.testing.assert_array_equal(tables.table[row], expected)
    assert len(set(tables.rows.values())) == len(tables.rows)  # no two requests share a row


_OPS = st.lists(st.tuples(st.sampled_from(["add", "grow", "finish", "preempt", "step"]),
                          st.integers(0, 5), st.integers(1, 6)), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops=_OPS, max_rows=st.integers(1, 4), max_blocks=st.integers(1, 4))
def test_persistent_tables_equal_the_block_lists_after_any_history(ops: list[tuple[str, int, int]], max_rows: int,
                                                                    max_blocks: int) -> None:
    tables = PersistentBlockTables(max_rows, max_blocks)  # small on purpose: rows and width must grow
    live: dict[str, list[int]] = {}
    given: dict[str, list[int]] = {}  # each request's list when it was last scheduled: what its row must hold
    preemptions: dict[str, int] = {}
    objects: dict[str, Request] = {}  # one Request per admission, as the engine has
    next_block = 0

    def new_blocks(n: int) -> list[int]:
        nonlocal next_block
        # Reuse ids (as the pool's free queue does): a replaced list may share a prefix with the old one.
        ids = [(next_block + i) % 7 for i in range(n)]
        next_block += n
        return ids

    for op, who, n in ops:
        rid = f"r{who}"
        if op == "add" and rid not in live:
            live[rid] = new_blocks(n)
            preemptions[rid] = 0
            objects[rid] = Request(rid, [1, 2, 3], SamplingParams())
        elif op == "grow" and rid in live:
            live[rid] = live[rid] + new_blocks(n)  # a new list object, as KVCacheManager.allocate makes
        elif op == "finish" and rid in live:
            del live[rid]
            given.pop(rid, None)
            tables.forget(rid)  # finished or aborted: EngineCore tells the runner
        elif op == "preempt" and rid in live:
            # Freed and re-allocated without telling the runner; the prefix may be a cache hit.
            preemptions[rid] += 1
            live[rid] = live[rid][:n % (len(live[rid]) + 1)] + new_blocks(n)
        elif op == "step" and live:
            chosen = sorted(live)[: 1 + who % len(live)]
            rows = tables.rows_for([_fake(r, live[r], preemptions[r], objects[r]) for r in chosen])
            assert [tables.rows[r] for r in chosen] == rows.tolist()
            given.update({r: live[r] for r in chosen})
        _check_rows(tables, given)


# ---------------------------------------------------------------- through the real scheduler


def _assert_group_equal(fast: GroupMetadata | None, slow: GroupMetadata | None) -> None:
    assert (fast is None) == (slow is None)
    if fast is None or slow is None:
        return
    torch.testing.assert_close(fast.block_table, slow.block_table, rtol=0, atol=0)
    torch.testing.assert_close(fast.seq_lens, slow.seq_lens, rtol=0, atol=0)
    assert (fast.token_start, fast.num_tokens, fast.max_query_len) == (slow.token_start, slow.num_tokens,
                                                                       slow.max_query_len)
    assert (fast.pad_index is None) == (slow.pad_index is None)
    if fast.pad_index is not None and slow.pad_index is not None:
        torch.testing.assert_close(fast.pad_index, slow.pad_index, rtol=0, atol=0)
    if fast.has_mask:  # the fast path leaves it out only where the decode kernel serves
        assert slow.has_mask
        for sliding in (False, True):
            torch.testing.assert_close(fast.dense_mask(sliding), slow.dense_mask(sliding), rtol=0, atol=0)


def _assert_inputs_equal(fast: ModelInput, slow: ModelInput) -> None:
    for name in ("input_ids", "positions", "sample_indices"):
        torch.testing.assert_close(getattr(fast, name), getattr(slow, name), rtol=0, atol=0)
    if fast.every_row_sampled:  # the runner then takes the hidden rows as they are, ungathered
        assert fast.sample_indices.tolist() == list(range(fast.input_ids.shape[0]))
    torch.testing.assert_close(fast.meta.slot_mapping, slow.meta.slot_mapping, rtol=0, atol=0)
    _assert_group_equal(fast.meta.decode, slow.meta.decode)
    _assert_group_equal(fast.meta.prefill, slow.meta.prefill)
    assert [s.request.request_id for s in fast.sampled] == [s.request.request_id for s in slow.sampled]


_EVENTS = st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "abort"]),
                             st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=_EVENTS, num_blocks=st.integers(6, 24), budget=st.sampled_from([8, 16, 64]),
       sliding=st.sampled_from([None, 5]), decode_mask=st.booleans())
def test_inputs_from_persistent_tables_equal_a_rebuild_every_step(events: list[tuple[str, int, int]], num_blocks: int,
                                                                   budget: int, sliding: int | None,
                                                                   decode_mask: bool) -> None:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4)
    scheduler = Scheduler(config, KVCacheManager(num_blocks, BS, True), max_model_len=num_blocks * BS)
    tables = PersistentBlockTables(2, 2)
    ids = 0
    for kind, size, max_tokens in events:
        if kind == "add":
            prompt = [(ids * 3 + i) % 11 for i in range(min(size, num_blocks * BS - max_tokens - 1))]
            if not prompt:
                continue
            scheduler.add(Request(f"q{ids}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
            ids += 1
        elif kind == "abort" and scheduler.requests:
            rid = sorted(scheduler.requests)[size % len(scheduler.requests)]
            scheduler.abort(rid)
            tables.forget(rid)
        else:
            out = scheduler.schedule()
            if out.is_empty:
                continue
            fast = build_model_input(out.scheduled, BS, sliding, CPU, tables, decode_mask=decode_mask)
            slow = build_model_input(out.scheduled, BS, sliding, CPU)
            _assert_inputs_equal(fast, slow)
            if decode_mask and fast.meta.decode is not None:
                assert fast.meta.decode.has_mask
            sampled = {s.request.request_id: SampledTokens([size % 11], [None]) for s in out.scheduled
                       if s.needs_sample}
            for o in scheduler.update(out, RunnerOutput(sampled=sampled)):
                if o.finished:
                    tables.forget(o.request_id)
    assert set(tables.rows) <= set(scheduler.requests)


def test_a_decode_group_on_the_kernel_carries_no_mask_and_a_prefill_keeps_its_own() -> None:
    tables = PersistentBlockTables(4, 6)
    decode = ScheduledRequest(Request("d", [1] * 9, SamplingParams()), 8, 1, [3, 5, 6])
    assert MAX_DECODE_QUERY < 20
    prefill = ScheduledRequest(Request("p", [2] * 20, SamplingParams()), 0, 20, [1, 2, 4, 7, 9])
    inp = build_model_input([decode, prefill], BS, None, CPU, tables, decode_mask=False)
    assert inp.meta.decode is not None and not inp.meta.decode.has_mask
    assert inp.meta.prefill is not None and inp.meta.prefill.has_mask
    assert inp.meta.prefill.mask is None, "a prefill group's mask waits for its first reader"
    mask = inp.meta.prefill.dense_mask(False)
    assert mask.shape == (1, 1, 20, 5 * BS) and mask[0, 0].tolist() == [[k <= q for k in range(5 * BS)]
                                                                        for q in range(20)]
    assert inp.meta.slot_mapping.tolist() == [6 * BS, *range(1 * BS, 3 * BS), *range(4 * BS, 5 * BS),
                                              *range(7 * BS, 8 * BS), *range(9 * BS, 10 * BS)]
    assert inp.meta.decode.block_table.tolist() == [[3, 5, 6]]


@pytest.mark.parametrize("fast", [True, False])
def test_rows_are_reused_after_forget_and_the_table_grows_past_max_num_seqs(fast: bool) -> None:
    tables = PersistentBlockTables(2, 2)
    scheduled = [_fake(f"r{i}", list(range(i, i + 5)), 0) for i in range(5)]
    rows = tables.rows_for(scheduled)
    assert len(set(rows.tolist())) == 5 and tables.table.shape[0] >= 5 and tables.width >= 5
    if fast:
        tables.forget("r0")
        assert tables.rows_for([_fake("new", [9], 0)]).tolist() == [rows[0]]
        _check_rows(tables, {"new": [9], **{f"r{i}": list(range(i, i + 5)) for i in range(1, 5)}})
    else:
        tables.reset()
        assert not tables.rows and not tables.table.any()


def test_a_one_token_chunk_short_of_its_prompt_is_not_sampled_on_the_plain_decode_path() -> None:
    # A prompt chunk of one token that does not reach the prompt's end rides in the decode group but
    # yields no token: the runner must gather the sampled rows, not take every hidden row.
    tables = PersistentBlockTables(4, 4)
    decode = ScheduledRequest(Request("d", [1] * 9, SamplingParams()), 8, 1, [3, 5, 6])
    chunk = ScheduledRequest(Request("c", [2] * 12, SamplingParams()), 4, 1, [1, 2, 4])  # token 5 of 12
    inp = build_model_input([chunk, decode], BS, None, CPU, tables, decode_mask=False)
    assert not inp.every_row_sampled and inp.sample_indices.tolist() == [1]
    assert [s.request.request_id for s in inp.sampled] == ["d"]
    both = build_model_input([decode], BS, None, CPU, tables, decode_mask=False)
    assert both.every_row_sampled and both.sample_indices.tolist() == [0]
