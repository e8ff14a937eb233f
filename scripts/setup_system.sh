#!/usr/bin/env bash
# System packages the test suite needs: numactl (DeepSpeed ZeRO-3 on CPU calls it). Installed with apt when
# missing and running as root; otherwise say what to install.
set -euo pipefail
if command -v numactl >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q numactl >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q numactl >/dev/null; }
else
    echo "numactl is missing: install it (e.g. sudo apt-get install numactl) for the DeepSpeed ZeRO-3 tests" >&2
fi
