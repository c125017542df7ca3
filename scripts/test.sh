#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set up the environment, then run every test.
# Extra arguments go to pytest. pytest's own exit code is returned unchanged: 5 (no tests
# collected) fails, like any other non-zero code.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/bootstrap.sh"
cd "$root"
exec .venv/bin/python -m pytest tests -p no:cacheprovider "$@"
