"""The server tests' live tiny-model fixtures, shared: one engine and one server per session."""

from tests.server.conftest import live, tiny_engine, tiny_model_dir  # noqa: F401  # pytest fixtures
