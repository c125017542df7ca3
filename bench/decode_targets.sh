#!/usr/bin/env bash
# Issue 12's "done when" rows on one GPU, on the code as it stands, in one or two device calls.
#
#   bash bench/decode_targets.sh speed OUTDIR   # parity, then dsv3-small bf16/fp8, glm5-small DSA, llama3-8b
#   bash bench/decode_targets.sh served OUTDIR  # the node as served vs the engine, then MTP at 61 layers
#   bash bench/decode_targets.sh depth OUTDIR   # issue 24's rows at full depth: parity, GLM-5.1 fp8 1K-200K, DeepSeek-V3 fp8
#   bash bench/decode_targets.sh depth2 OUTDIR  # the rest of issue 24's table: MTP at 78 layers, TP8 shard, bf16, llama3-8b
#
# Each step writes its JSON (named by model, dtype and date) and its log under OUTDIR and prints how long it took;
# a failed step is reported and the next one still runs. Needs torch + triton on a CUDA device; the decode node
# (served) also needs tilepd's server dependencies (pydantic, fastapi, uvicorn, ...).
set -u
part=${1:?part: speed or served}
out=${2:?output folder}
mkdir -p "$out"
day=$(date -u +%F)
py=${PYTHON:-python3}

step() {  # step NAME CMD...: run one bench, its log beside its JSON
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*"
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 25 "$out/$name.log"
}

case "$part" in
  speed)
    step parity "$py" -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_mla_gpu_parity.py
    for w in bf16 fp8; do
      step "dsv3-small_$w" "$py" bench/decode_speed.py --model dsv3-small --weights "$w" --contexts 1024 8192 32768 \
        --tokens 128 --no-hf --variants speed-path --json --out "$out/dsv3-small_${w}_targets_$day.json"
    done
    step glm5-small_bf16 "$py" bench/decode_speed.py --model glm5-small --contexts 1024 8192 32768 --tokens 128 --no-hf \
      --variants speed-path --json --out "$out/glm5-small_bf16_targets_$day.json"
    step llama3-8b_bf16 "$py" bench/decode_speed.py --model llama3-8b --contexts 1024 8192 --tokens 128 --no-hf \
      --variants speed-path --json --out "$out/llama3-8b_bf16_targets_$day.json"
    ;;
  served)
    step served "$py" bench/served_decode.py --json --out "$out/served-decode_llama3-8b_bf16_targets_$day.json"
    step mtp-61L "$py" bench/decode_speed.py --model dsv3-small --layers 61 --mtp-forced-accept --contexts 1024 8192 \
      --tokens 128 --json --out "$out/dsv3-small-61L_bf16_mtp_targets_$day.json"
    ;;
  depth)
    # TILEPD_DSA_GPU_REFS: references prepared on a CPU box (tests/engine/test_dsa_gpu_parity.py), when carried
    step parity "$py" -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_dsa_gpu_parity.py \
      tests/engine/test_mla_gpu_parity.py tests/engine/test_fp8_gpu_parity.py
    step glm-5.1_fp8_78L "$py" bench/decode_speed.py --model glm-5.1 --weights fp8 --no-hf --no-mtp --variants speed-path \
      --contexts 1024 32768 131072 200000 --tokens 64 --json --out "$out/glm-5.1_fp8_78L_decode_speed_$day.json"
    step deepseek-v3_fp8_61L "$py" bench/decode_speed.py --model deepseek-v3 --weights fp8 --no-hf --no-mtp \
      --variants speed-path --contexts 1024 32768 --tokens 64 --json --out "$out/deepseek-v3_fp8_61L_decode_speed_$day.json"
    ;;
  depth2)
    step glm-5.1_fp8_78L_mtp "$py" bench/decode_speed.py --model glm-5.1 --weights fp8 --mtp-forced-accept \
      --contexts 1024 --tokens 64 --json --out "$out/glm-5.1_fp8_78L_mtp_$day.json"
    step tp-shard-step "$py" bench/tp_shard_step.py --contexts 1024 131072 --tokens 128 --json \
      --out "$out/tp-shard-step_glm51_fp8_tp8_h200_$day.json"
    step glm-5.1_bf16_78L "$py" bench/decode_speed.py --model glm-5.1 --weights bf16 --no-hf --no-mtp --variants speed-path \
      --contexts 1024 --tokens 64 --json --out "$out/glm-5.1_bf16_78L_decode_speed_$day.json"
    step llama3-8b_bf16 "$py" bench/decode_speed.py --model llama3-8b --contexts 1024 8192 --tokens 128 --no-hf \
      --variants speed-path --json --out "$out/llama3-8b_bf16_decode_speed_$day.json"
    ;;
  *) echo "unknown part: $part (speed, served, depth or depth2)" >&2; exit 2 ;;
esac
