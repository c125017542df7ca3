#!/usr/bin/env bash
# The bounded soak (not part of the test suite): a local deployment with two decode nodes, a native
# pool and the router, concurrent streaming clients, decode-node faults on a schedule. Prints
# `soak: requests N / completed N / typed errors N / lost = N`; exits non-zero when a request was lost
# or fds/threads/memory grew past the bounds. Extra arguments go to bench/soak.py (--duration-s, --clients, ...).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/bootstrap.sh"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python bench/soak.py "$@"
