"""The bounded map under what clients can make the server keep: exact evictions by count and by size."""

from __future__ import annotations

from tokenmill.bounded_lru import BoundedLru
from tokenmill.server.response_store import ResponseStore, StoredResponse


def test_the_least_recently_used_go_first_by_count_and_by_size() -> None:
    lru: BoundedLru[str, str] = BoundedLru(max_entries=3, max_size=10, size_of=len)
    for key in ("a", "b", "c"):
        lru.put(key, key * 3)  # 3 characters each
    assert lru.get("a") == "aaa"  # a is now the most recently used
    lru.put("d", "ddd")  # a fourth entry: b goes
    assert [lru.get(k) is not None for k in "abcd"] == [True, False, True, True] and lru.size == 9
    lru.put("e", "eeeee")  # 14 characters over 10: the least recently used go until it fits (a, then c)
    assert [lru.get(k) is not None for k in "acde"] == [False, False, True, True] and lru.size == 8
    lru.put("d", "x" * 11)  # larger than the whole budget: not kept, and the old d is gone too
    assert lru.get("d") is None and lru.size == 5 and len(lru) == 1
    assert lru.pop("e") == "eeeee" and lru.size == 0 and lru.pop("e") is None


def test_a_huge_conversation_does_not_pin_the_response_store() -> None:
    store = ResponseStore(capacity=1000, max_bytes=4000)
    for i in range(5):
        store.put(f"r{i}", StoredResponse(None, [{"role": "user", "content": "x" * 900}], {"id": f"r{i}"}))
    assert len(store) == 4  # ~950 bytes each: the fifth pushed the first out
    assert store.get("r0", None) is None and store.get("r4", None) is not None
    store.put("huge", StoredResponse(None, [{"role": "user", "content": "x" * 5000}], {"id": "huge"}))
    assert store.get("huge", None) is None and len(store) == 4  # over the whole budget: answered, not kept
