#!/usr/bin/env bash
# System packages the test suite needs: numactl (DeepSpeed ZeRO-3 on CPU calls it) and chromium (the run
# report is checked by a headless screenshot). Installed with apt when missing and running as root;
# otherwise say what to install.
set -euo pipefail
missing=()
command -v numactl >/dev/null 2>&1 || missing+=(numactl)
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing+=(chromium)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || {
        apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; }
else
    echo "missing system packages: ${missing[*]} (e.g. sudo apt-get install ${missing[*]}); numactl is needed by" \
         "the DeepSpeed ZeRO-3 tests, chromium by the run-report screenshot test" >&2
fi
