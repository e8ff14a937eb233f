"""Build DeepSpeed's C++ ops once, up front, so no test or run pays for (or races on) the JIT build.

Builds into TORCH_EXTENSIONS_DIR (default: <venv>/torch_extensions, the same default the test suite uses).
Stale `lock` files left by a killed build would make every later build wait forever, so they are removed
first (nothing else builds while this runs).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


def main() -> int:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print("deepspeed is not installed: nothing to build")
        return 0
    from deepspeed.accelerator import get_accelerator

    root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    for lock in root.rglob("lock"):
        lock.unlink()
    accelerator = get_accelerator()
    names = ["CPUAdamBuilder", "FusedAdamBuilder"]
    if accelerator.device_name() == "cpu":
        names.append("ShareMemCommBuilder")
    for name in names:
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible():
            print(f"{name}: not available on {accelerator.device_name()}, skipped")
            continue
        start = time.perf_counter()
        builder.load()
        print(f"{name}: ready in {time.perf_counter() - start:.0f} s ({root})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
