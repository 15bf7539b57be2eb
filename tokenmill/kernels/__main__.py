"""`python -m tokenmill.kernels`: build (or find cached) the native CPU kernels and say where."""

from __future__ import annotations

import logging
import sys

from tokenmill.kernels import available_quant_isas, cpu_kernels, isa_key, quant_kernels


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name, module in (("native CPU kernels", cpu_kernels()), ("native quantized kernels", quant_kernels())):
        if module is None:
            print(f"{name} unavailable: tokenmill will use its PyTorch fallbacks", file=sys.stderr)
        else:
            print(f"{name} ready: {module.__file__}")
    print(f"instruction-set key {isa_key()}; quant paths this CPU runs: {', '.join(available_quant_isas()) or 'none'}")
    return 0  # not an install failure: every kernel has a fallback


if __name__ == "__main__":
    sys.exit(main())
