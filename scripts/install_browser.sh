#!/usr/bin/env bash
# The playground's browser test (tests/test_playground.py) drives Debian's Chromium with Selenium.
# Installs chromium and chromium-driver with apt when either is missing; a no-op (milliseconds) when both
# are there. Measured on the 2-core CI machine: 39 s for apt-get install (116 new packages, 505 MB on disk).
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "install_browser.sh: chromium/chromedriver missing and no apt-get here: install Chromium and its driver" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -q chromium chromium-driver >/dev/null || {
    $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium chromium-driver >/dev/null; }
command -v chromium >/dev/null && command -v chromedriver >/dev/null
