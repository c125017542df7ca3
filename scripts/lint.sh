#!/usr/bin/env bash
# The linters (seconds; scripts/test.sh runs this before the suite): ruff ([tool.ruff] in pyproject.toml),
# yamllint (.yamllint) and ansible-lint (.ansible-lint, offline). Any finding fails; every skip is documented
# in its config with the reason.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bin="${TILEPD_LINT_BIN:-$root/.venv/bin}"
"$bin/ruff" check --no-cache .
"$bin/yamllint" --strict .
# the playbooks' own ansible.cfg gives ansible-lint the roles path, as it gives `tilepd up`
ANSIBLE_CONFIG="$root/playbooks/ansible.cfg" "$bin/ansible-lint" -q playbooks/
