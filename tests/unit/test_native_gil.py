"""Long native calls release the GIL (c_api.h's ReleaseGilIfLong).

The server's event loop shares the process with the engine thread: a prefill's GEMM or an elementwise
pass over a [2048, 9728] activation (tens of milliseconds to seconds on a CPU) must not hold the GIL,
or no request is read and no token is streamed meanwhile. Held, another Python thread stalls for the
whole call; released, only for OS time slices on a busy machine.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import pytest
import torch

from tokenmill.kernels import cpu_kernels, glue_kernels, quant_kernels
from tokenmill.layers import quant_formats as qf


def longest_stall(call: Callable[[], object]) -> tuple[float, float]:
    """(the longest time another Python thread could not run during `call()`, the call's duration)."""
    ticks: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())

    thread = threading.Thread(target=spin)
    thread.start()
    while not ticks:  # the spinner runs before the call starts
        time.sleep(0.001)
    started = time.perf_counter()
    call()
    ended = time.perf_counter()
    stop.set()
    thread.join()
    inside = [started] + [t for t in ticks if started < t < ended] + [ended]
    return max(b - a for a, b in itertools.pairwise(inside)), ended - started


def assert_releases(call: Callable[[], object]) -> None:
    call()  # warm: first-touch page faults and lazy initialisation are not the call
    stall, duration = longest_stall(call)
    assert stall < 0.5 * duration, f"another thread stalled {stall * 1e3:.1f} ms of a {duration * 1e3:.1f} ms call"


def test_quantized_gemms_release_the_gil() -> None:
    kernels = quant_kernels()
    if kernels is None:
        pytest.skip("native quantized kernels cannot be built here")
    torch.manual_seed(0)
    mat = qf.quantize(torch.randn(2048, 2048), "q8")
    # 8G multiply-adds: ~26 ms on a Zen 5, where 512 rows took 6.5 ms, about an OS time slice, and the
    # spinner then sometimes stalled the whole call beside the kernel's two threads on two vCPUs.
    x = torch.randn(2048, 2048)
    isa = max(kernels.cpu_isas())
    plan = kernels.QuantPlan([mat.qs], [mat.scale], [mat.offset], [mat.rows], 2, isa, None, [mat.high], 0)
    assert_releases(lambda: plan(x))
    assert_releases(lambda: kernels.quant_linear(x, [mat.qs], [mat.scale], [mat.offset], [mat.rows], 2, isa,
                                                 [mat.high]))


def test_elementwise_and_cache_kernels_release_the_gil() -> None:
    cpu, glue = cpu_kernels(), glue_kernels()
    if cpu is None or glue is None:
        pytest.skip("native kernels cannot be built here")
    gate_up = torch.randn(4096, 8192)  # a prefill's MLP activation, 32M elements
    assert_releases(lambda: cpu.silu_mul(gate_up))
    x, w = torch.randn(16384, 2048), torch.ones(2048)
    assert_releases(lambda: glue.rms_norm(x, w, 1e-6))
    # 2 x 128 MiB written: a 16K-token write took 2.7 ms on a Zen 5, within one OS time slice, so the
    # spinner's stall measured the scheduler rather than the GIL.
    k = torch.randn(65536, 8, 64)
    caches = torch.zeros(2, 4096, 16, 8, 64)
    slots = torch.randperm(4096 * 16).contiguous()
    assert_releases(lambda: cpu.kv_write(caches[0], caches[1], slots, k, k))
