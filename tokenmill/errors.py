"""User-facing errors: one line that says what went wrong and what to do about it."""


class TokenmillError(Exception):
    """An error whose message is shown to the user as-is (CLI: one line; HTTP: an error body)."""


class ModelNotFoundError(TokenmillError):
    """The model name is neither a catalog entry nor a path on disk."""


class ModelNotInstalledError(TokenmillError):
    """A catalog model whose packages are not installed yet."""


class ModelFormatError(TokenmillError):
    """A model file that is corrupt, truncated or of an unsupported architecture."""


class IntegrityError(TokenmillError):
    """A downloaded or assembled file whose SHA-256 does not match the catalog."""


class RequestValidationError(TokenmillError):
    """A request the engine cannot run (e.g. prompt longer than the context); `param` names the
    request field at fault, for API error bodies."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
