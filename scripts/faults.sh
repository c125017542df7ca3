#!/usr/bin/env bash
# The long fault runs under load (pytest marker `faults`, minutes each), kept out of the suite's time budget:
# the decode-node faults under the router (SIGKILL / SIGSTOP before the first token and mid-stream) and
# the rolling restart of every decode node under a steady request stream. Extra arguments go to pytest;
# pytest's exit code is returned unchanged (5, nothing collected, fails too).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/bootstrap.sh"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python -m pytest tests -p no:cacheprovider -m faults --durations=20 "$@"
