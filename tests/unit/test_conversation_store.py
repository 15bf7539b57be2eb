"""ConversationStore: owned by an API key, bounded in count and bytes, immutable values (the size budget
stays exact as items are added)."""

from __future__ import annotations

from tokenmill.server.conversations import ConversationStore


def _item(i: int, text: str = "x") -> dict[str, object]:
    return {"type": "message", "id": f"msg_{i}", "role": "user", "status": "completed",
            "content": [{"type": "input_text", "text": text}]}


def test_another_owner_sees_nothing_and_cannot_change_it() -> None:
    store = ConversationStore(10, 1 << 20)
    conv = store.create("api-key-0", [_item(0)], {})
    assert store.get(conv.conversation_id, "api-key-1") is None and store.get(conv.conversation_id, None) is None
    assert not store.append(conv.conversation_id, "api-key-1", [_item(1)])
    assert not store.delete(conv.conversation_id, "api-key-1")
    assert store.append(conv.conversation_id, "api-key-0", [_item(1)])
    assert [i["id"] for i in store.get(conv.conversation_id, "api-key-0").items] == ["msg_0", "msg_1"]  # type: ignore[union-attr]
    assert store.delete(conv.conversation_id, "api-key-0") and len(store) == 0
    assert not store.append(conv.conversation_id, "api-key-0", [_item(2)])  # gone: nothing to add to


def test_growing_conversations_evict_the_least_recently_used_by_bytes() -> None:
    store = ConversationStore(10, 4000)
    old = store.create(None, [_item(0, "a" * 1000)], {})
    new = store.create(None, [_item(1, "b" * 1000)], {})
    assert store.get(old.conversation_id, None) is not None  # used: now the most recent
    store.append(new.conversation_id, None, [_item(2, "c" * 1200)])  # appending re-measures
    assert store.get(old.conversation_id, None) is not None and len(store) == 2
    store.append(new.conversation_id, None, [_item(3, "d" * 1200)])  # 4.8 KB in all now: the other one goes
    assert store.get(old.conversation_id, None) is None and store.get(new.conversation_id, None) is not None
