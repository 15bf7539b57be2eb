"""Engine tests run tiny models: one intra-op thread is fastest, and on a busy machine several
threads spin on each other for hundreds of milliseconds per step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
