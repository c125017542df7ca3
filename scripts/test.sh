#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set up the environment, then run every test.
# Extra arguments go to pytest. pytest's own exit code is returned unchanged: 5 (no tests
# collected) fails, like any other non-zero code.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/bootstrap.sh"
cd "$root"
# The cached venv is shared by every checkout on this machine and its editable install points at
# whichever one bootstrapped last; this checkout's own code always comes first for the tests and
# every process they start.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# The linters first (seconds): a finding fails the run before the suite starts.
bash "$root/scripts/lint.sh"
# The long fault runs (marker `faults`, minutes each) have their own command: scripts/faults.sh.
exec .venv/bin/python -m pytest tests -p no:cacheprovider -m "not faults" --durations=20 "$@"
