"""`python -m tokenmill.kernels`: build (or find cached) the native CPU kernels and say where."""

from __future__ import annotations

import logging
import sys

from tokenmill.kernels import cpu_kernels


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = cpu_kernels()
    if module is None:
        print("native CPU kernels unavailable: tokenmill will use its PyTorch fallbacks", file=sys.stderr)
        return 0  # not an install failure: every kernel has a fallback
    print(f"native CPU kernels ready: {module.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
