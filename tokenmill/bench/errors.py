"""The bench's user-facing error: one line that says what to do, printed by the CLI like any
TokenmillError (tokenmill.errors is a leaf module: the bench still imports nothing of the engine)."""

from tokenmill.errors import TokenmillError


class BenchError(TokenmillError):
    pass
