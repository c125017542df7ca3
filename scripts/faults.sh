#!/usr/bin/env bash
# The long fault runs under load (pytest marker `faults`, minutes each), kept out of the suite's time budget:
# the decode-node faults under the router (SIGKILL / SIGSTOP before the first token and mid-stream),
# the rolling restart of every decode node under a steady request stream, and the HA stack through a real `tilepd up`
# (two routers behind HAProxy: 2x20 clients for 2 min, a router's SIGKILL, a rolling router restart; tests/deploy/
# test_ha_stack.py, 7 min on the 2-core box). Extra arguments go to pytest;
# pytest's exit code is returned unchanged (5, nothing collected, fails too).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/bootstrap.sh"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python -m pytest tests -p no:cacheprovider -m faults --durations=20 "$@"
