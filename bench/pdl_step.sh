#!/usr/bin/env bash
# Issue 24: the decode step with programmatic dependent launch (tilepd/engine/pdl.py) against without, in one device call.
#
#   bash bench/pdl_step.sh ab OUTDIR      # GLM-5.1 fp8 78 layers at 1K: off / on / on without
#                                         # the weight prefetch, each profiled; the MoE block's GPU parity + times with the defaults
#   bash bench/pdl_step.sh table OUTDIR   # GPU parity with the defaults, then issue 24's rows, each off then on
#   bash bench/pdl_step.sh variants OUTDIR SECONDS  # GLM-5.1 1K under each PDL switch setting, then GPU parity with PDL on
#   bash bench/pdl_step.sh one OUTDIR SECONDS  # what fits one call, by value: GLM-5.1 1K/32K/128K on, 1K off, GPU parity,
#                                              # the TP8 shard on, DeepSeek-V3 1K on, then off; each step cut at the deadline
#
# "off" is TILEPD_PDL=0: the kernels as they launched before (no griddepcontrol, no prefetch, the shared expert summed
# last); "on" below is PDL's widest form (early trigger and prefetch). TILEPD_MOE_FUSED_GATE_RANKED selected a top-k
# by ranks in the gate kernel, measured slower and removed (2026-12-03); the runs that set it are kept as they ran.
# The "notrigger" variants set TILEPD_PDL_EARLY empty: since 2026-12-07 some sites trigger early by default (pdl.EARLY);
# they also set TILEPD_PDL_PRELOAD_AT empty: since the eighth session of that day the attention's fp8 GEMVs load their
# first weight chunk before the wait by default (pdl.PRELOAD), which only pays with a trigger.
# Each step: its JSON and log under OUTDIR.
set -u
part=${1:?part: ab, table, variants or one}
out=${2:?output folder}
mkdir -p "$out"
day=$(date -u +%F)
py=${PYTHON:-python3}
off=(TILEPD_PDL=0)
on=(TILEPD_PDL=1 TILEPD_PDL_TRIGGER=1 TILEPD_PDL_PREFETCH=1)
noprefetch=(TILEPD_PDL=1 TILEPD_PDL_TRIGGER=1 TILEPD_PDL_PREFETCH=0)

deadline=${3:-100000}  # seconds from the start after which no step runs on (part "one")

source "$(dirname "${BASH_SOURCE[0]}")/steps.sh"

case "$part" in
  ab)
    step glm-1k-off 150 env "${off[@]}" bash -c "$(model_fns); glm pdl-off 1024"
    step glm-1k-on 150 env "${on[@]}" bash -c "$(model_fns); glm pdl-on 1024"
    step glm-1k-noprefetch 150 env "${noprefetch[@]}" bash -c "$(model_fns); glm pdl-noprefetch 1024"
    step moe-fused 100 "$py" bench/moe_fused_gpu.py --trials 1 --no-sweep --out "$out/moe-fused-gpu_h200_${day}-pdl.json"
    ;;
  table)
    parity parity 240
    for mode in off on; do
      envs=("${on[@]}"); [ "$mode" = off ] && envs=("${off[@]}")
      step "glm-long-$mode" 300 env "${envs[@]}" TILEPD_X=1 bash -c "$(model_fns); glm pdl-$mode 1024 32768 131072"
      step "dsv3-$mode" 150 env "${envs[@]}" TILEPD_X=1 bash -c "$(model_fns); dsv3 pdl-$mode"
      step "tp8-$mode" 150 env "${envs[@]}" TILEPD_X=1 bash -c "$(model_fns); tp8 pdl-$mode"
    done
    ;;
  one)
    step glm-on 200 env "${on[@]}" bash -c "$(model_fns); glm pdl-on 1024 32768 131072"
    step glm-1k-off 110 env "${off[@]}" bash -c "$(model_fns); glm pdl-off 1024"
    parity parity 200
    step tp8-on 100 env "${on[@]}" bash -c "$(model_fns); tp8 pdl-on"
    step dsv3-on 100 env "${on[@]}" bash -c "$(model_fns); dsv3 pdl-on"
    step tp8-off 100 env "${off[@]}" bash -c "$(model_fns); tp8 pdl-off"
    step dsv3-off 100 env "${off[@]}" bash -c "$(model_fns); dsv3 pdl-off"
    ;;
  variants)  # GLM-5.1 1K under each switch setting (what makes PDL slower or faster), then GPU parity with PDL's widest form
    v() { local tag=$1; shift; step "glm-1k-$tag" 60 env "$@" bash -c "$(model_fns); glm $tag 1024"; }
    v off "${off[@]}"
    v on "${on[@]}"
    v noprefetch TILEPD_PDL=1 TILEPD_PDL_TRIGGER=1 TILEPD_PDL_PREFETCH=0
    v notrigger TILEPD_PDL=1 TILEPD_PDL_TRIGGER=0 TILEPD_PDL_PREFETCH=0 TILEPD_PDL_EARLY= TILEPD_PDL_PRELOAD_AT=
    v small-only TILEPD_PDL=1 TILEPD_PDL_TRIGGER=1 TILEPD_PDL_PREFETCH=1 TILEPD_PDL_SKIP=gemv,gate_up,down
    v no-moe-gemv TILEPD_PDL=1 TILEPD_PDL_TRIGGER=1 TILEPD_PDL_PREFETCH=1 TILEPD_PDL_SKIP=gate_up,down
    v notrigger-small TILEPD_PDL=1 TILEPD_PDL_TRIGGER=0 TILEPD_PDL_PREFETCH=0 TILEPD_PDL_EARLY= TILEPD_PDL_PRELOAD_AT= TILEPD_PDL_SKIP=gemv,gate_up,down
    parity parity 120 "${on[@]}"
    ;;
  *) echo "unknown part: $part (ab, table, one or variants)" >&2; exit 2 ;;
esac
