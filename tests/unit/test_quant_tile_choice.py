"""Which tiles the quant kernel's avx512vnni path picks on this CPU, and the overrides A/B runs use.
The picks change speed only: every tile gives the same bits (tests/unit/test_quant_kernels.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.kernels import cpu_vendor_family, quant_kernels

kernels = quant_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="native quantized kernels cannot be built here")


def test_wide_and_duo_tile_choices_are_the_cpus_and_can_be_overridden() -> None:
    """avx512vnni runs 512-bit tiles from wide_min_rows() activation rows up (5 on Zen 4, 8 on Zen 5, else 4; the
    outputs are the same bits either way); TOKENMILL_QUANT_WIDE_ROWS pins it for A/B runs."""
    assert kernels is not None
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    vendor, family = cpu_vendor_family(cpuinfo)
    expected = 4 if vendor != "AuthenticAMD" else 5 if family == 25 else 8 if family >= 26 else 4
    if "TOKENMILL_QUANT_WIDE_ROWS" not in os.environ:
        assert kernels.wide_min_rows() == expected
    code = "from tokenmill.kernels import quant_kernels; print(quant_kernels().wide_min_rows())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TOKENMILL_QUANT_WIDE_ROWS": "1"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "1"
    # The duo tiles (1-8 rows): on by default where measured (Zen 5), off elsewhere.
    if "TOKENMILL_QUANT_DUO" not in os.environ:
        assert kernels.duo_tiles() == (vendor == "AuthenticAMD" and family >= 26)
    code = "from tokenmill.kernels import quant_kernels; print(quant_kernels().duo_tiles())"
    flipped = "0" if kernels.duo_tiles() else "1"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TOKENMILL_QUANT_DUO": flipped},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == str(flipped == "1")
