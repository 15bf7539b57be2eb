"""One page of a list of items, as OpenAI's list endpoints answer it (a response's input_items, a
conversation's items): `order` asc | desc, at most `limit`, cursors by item id (`after`: the page that
follows it; `before`: the page just before it), `first_id` / `last_id` / `has_more`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from tokenmill.server.errors import ApiError

Json = dict[str, Any]
Order = Literal["asc", "desc"]


def item_page(items: Sequence[Json], limit: int, order: Order, after: str | None, before: str | None,
              owner: str) -> Json:
    """`owner` names what holds the items, for the 400 of a cursor that is not one of them."""
    ordered = list(items) if order == "asc" else list(items)[::-1]
    ids = [item["id"] for item in ordered]
    start, end = 0, len(ordered)
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise ApiError(400, f"{name}: no item {cursor!r} in {owner}", param=name)
    if after is not None:
        start = ids.index(after) + 1
    if before is not None:
        end = ids.index(before)
    if before is not None and after is None:  # the page just before the cursor (a previous page)
        first = max(start, end - limit)
        page, has_more = ordered[first:end], first > start
    else:
        page = ordered[start:end][:limit]
        has_more = start + len(page) < end
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": has_more}
