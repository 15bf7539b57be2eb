"""A request body's validation errors (pydantic's list) as the one-line message and field of a 400."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def describe_validation_errors(errors: Sequence[Any]) -> tuple[str, str | None]:
    """The first problem in a body (pydantic's error list) as one line, and the field it is about."""
    if not errors:
        return "the request body is invalid", None
    if errors[0].get("type") == "json_invalid":  # loc is ("body", <character offset>): no field to name
        reason = (errors[0].get("ctx") or {}).get("error", "it cannot be decoded")
        loc = errors[0].get("loc") or ()
        at = f" (at character {loc[-1]})" if loc and isinstance(loc[-1], int) else ""
        return f"the request body is not valid JSON: {reason}{at}", None
    fields = [[str(part) for part in e.get("loc", ()) if part != "body"] for e in errors]
    param = fields[0][0] if fields[0] else None
    messages = list(dict.fromkeys(str(e.get("msg", "invalid value")) for e in errors))
    if param is None:
        return messages[0], None
    if all(f[:1] == [param] for f in fields) and len(errors) > 1:
        # A union (prompt: str | list[str] | ...) reports one error per form it tried.
        return f"{param}: no accepted form matches: {'; '.join(messages[:3])}", param
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"{'.'.join(fields[0])}: {messages[0]}{more}", param
