"""The OpenAI-compatible HTTP server: FastAPI app, endpoints, admission control and `tokenmill serve`."""

from __future__ import annotations
