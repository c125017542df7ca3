#!/usr/bin/env bash
# Issue 24's rows at full depth on whichever card the device call got, in one call, with a deadline.
#
#   bash bench/depth_step.sh rows OUTDIR SECONDS   # the fused attention GEMVs' tile sweep (fp8_gemv_sweep --fused), then
#                                                  # the table's rows
#   bash bench/depth_step.sh table OUTDIR SECONDS  # the TP8 shard (layers aliased), GLM-5.1 fp8 78L 1K-200K, DeepSeek-V3
#                                                  # fp8 61L 1K/32K, GPU parity (DSA, MLA, fp8, TP8 shard), MTP at 78
#                                                  # layers, llama3-8b, GLM-5.1 bf16
#   bash bench/depth_step.sh ab OUTDIR SECONDS TAG VAR=VALUE...  # GLM-5.1 fp8 1K, DeepSeek-V3 fp8 1K and the TP8 shard 1K
#                                                  # as the code stands and with the settings, then GPU parity under the settings
#   bash bench/depth_step.sh ctx OUTDIR SECONDS CONTEXT TAG=VAR=VALUE[,VAR=VALUE]...  # GLM-5.1 fp8 at one context as
#                                                  # the code stands, then under each tagged setting
#   bash bench/depth_step.sh llama OUTDIR SECONDS TAG=VAR=VALUE[,VAR=VALUE]...  # llama3-8b 1K/8K as the code stands,
#                                                  # then under each tagged setting
#   bash bench/depth_step.sh tp8x OUTDIR SECONDS TAG=VAR=VALUE[,VAR=VALUE]...  # the TP8 shard at 1K as the code
#                                                  # stands, then under each tagged setting
#   bash bench/depth_step.sh long OUTDIR SECONDS   # dense MLA's long-window tiles (mla_dense_long.py picks TUNE_LONG),
#                                                  # then DeepSeek-V3 fp8 61L at 32K as the code stands and with the pick
#
# TILEPD_DSA_GPU_REFS: the DSA parity references made on a CPU box (tests/engine/test_dsa_gpu_parity.py, made with
# the project's transformers) and carried; without them that file makes its own with the device's transformers.
# Each step: its JSON and log under OUTDIR; a step past the deadline (seconds from the start) is skipped.
# BUNDLE=1: at the end OUTDIR becomes OUTDIR.tgz (a device call brings back at most 8 files; a table makes ~16).
set -u
part=${1:?part: rows, table, ab, ctx, llama, tp8x or long}
out=${2:?output folder}
deadline=${3:-100000}
mkdir -p "$out"
day=$(date -u +%F)
py=${PYTHON:-python3}

source "$(dirname "${BASH_SOURCE[0]}")/steps.sh"

each() {  # each NAME SECONDS FN TAG_PREFIX "ARGS" TAG=VAR=VALUE[,VAR=VALUE]...: a model function as the code stands, then
  # under each tagged setting (its steps NAME-default, NAME-TAG; its results tagged TAG_PREFIX + default / TAG)
  local name=$1 limit=$2 fn=$3 prefix=$4 args=$5 setting tag vars; shift 5
  step "$name-default" "$limit" bash -c "$(model_fns); $fn ${prefix}default $args"
  for setting in "$@"; do
    tag=${setting%%=*}; IFS=, read -r -a vars <<< "${setting#*=}"
    step "$name-$tag" "$limit" env "${vars[@]}" bash -c "$(model_fns); $fn $prefix$tag $args"
  done
}

case "$part" in
  rows)
    step fp8-fused-sweep 170 "$py" bench/fp8_gemv_sweep.py --fused --out "$out/fp8-fused-sweep_${gpu}_${day}.json"
    ;&  # then the table's rows
  table)  # issue 24's rows without the tile sweep, the model rows first (2026-12-06's call 3 took ~300 s on an H100)
    step tp8 80 bash -c "$(model_fns); tp8 main --alias-layers --contexts 1024 131072"
    step glm 200 bash -c "$(model_fns); glm main 1024 32768 131072 200000"
    step dsv3 90 bash -c "$(model_fns); dsv3 main 1024 32768"
    parity parity 240
    step mtp 150 "$py" bench/decode_speed.py --model glm-5.1 --weights fp8 --mtp-forced-accept --contexts 1024 --tokens 64 \
      --json --out "$out/glm-5.1_fp8_78L_mtp_${gpu}_${day}.json"
    step llama 100 bash -c "$(model_fns); llama main"
    step glm-bf16 80 "$py" bench/decode_speed.py --model glm-5.1 --weights bf16 --no-hf --no-mtp --variants speed-path \
      --contexts 1024 --tokens 64 --json --out "$out/glm-5.1_bf16_78L_decode_speed_${gpu}_${day}.json"
    ;;
  ab)
    tag=${4:?tag}; shift 4
    for side in default "$tag"; do
      if [ "$side" = default ]; then set_env=(); else set_env=("$@"); fi
      step "glm-$side" 60 env "${set_env[@]}" bash -c "$(model_fns); glm $side 1024"
      step "dsv3-$side" 60 env "${set_env[@]}" bash -c "$(model_fns); dsv3 $side"
      step "tp8-$side" 60 env "${set_env[@]}" bash -c "$(model_fns); tp8 $side --alias-layers --contexts 1024"
    done
    parity parity 240 "$@"
    ;;
  ctx)  # ctx OUTDIR SECONDS CONTEXT TAG=VAR=VALUE[,VAR=VALUE]...: GLM-5.1 fp8 at one context, default then each setting
    ctx=${4:?context}; shift 4
    each "glm-$ctx" 60 glm "$ctx-" "$ctx" "$@"
    ;;
  llama)  # llama OUTDIR SECONDS TAG=VAR=VALUE[,VAR=VALUE]...: llama3-8b, default then each setting
    shift 3
    each llama 100 llama "" "" "$@"
    ;;
  tp8x)  # tp8x OUTDIR SECONDS TAG=VAR=VALUE[,VAR=VALUE]...: the TP8 shard at 1K, default then each setting
    shift 3
    each tp8 60 tp8 "" "--alias-layers --contexts 1024" "$@"
    ;;
  long)
    step mla-long 240 "$py" bench/mla_dense_long.py --out "$out/mla-dense-long_${gpu}_${day}.json" --best-env "$out/long.env"
    [ -s "$out/long.env" ] && cat "$out/long.env"
    step dsv3-32k-default 100 bash -c "$(model_fns); dsv3 32k-default 32768"
    if [ -s "$out/long.env" ]; then
      step dsv3-32k-long 100 bash -c "source $out/long.env; $(model_fns); dsv3 32k-long 32768"
    fi
    ;;
  *) echo "unknown part $part (rows, table, ab, ctx, llama, tp8x or long)"; exit 2 ;;
esac
if [ "${BUNDLE:-0}" = 1 ]; then bundle; fi
