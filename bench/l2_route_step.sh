#!/usr/bin/env bash
# Issue 24: the fp8 GEMV's rolling L2 prefetch (fp8_triton TUNE pf_ahead, TILEPD_FP8_PF_AHEAD) and the MoE gate's routing
# by rows (moe_fused_triton TUNE gate_route_rows, TILEPD_MOE_FUSED_GATE_ROUTE_ROWS), each against without, in one device call.
#
#   bash bench/l2_route_step.sh one OUTDIR SECONDS   # the prefetch sweep on GLM-5.1's / DeepSeek-V3's attention GEMVs (picks
#                                                    # the distance), the MoE block's GPU parity, GLM-5.1 fp8 78L 1K: before,
#                                                    # both, each alone; GPU parity with both; DeepSeek-V3 61L 1K and the TP8
#                                                    # shard, before and both
#   bash bench/l2_route_step.sh long OUTDIR SECONDS PF  # GLM-5.1 32K/128K/200K, bf16 1K, MTP, llama3-8b with both (PF: the distance)
#
# "before" is TILEPD_FP8_PF_AHEAD=0 TILEPD_MOE_FUSED_GATE_ROUTE_ROWS=0: the kernels as on main before this change.
# Each step: its JSON and log under OUTDIR; a step past the deadline (seconds from the start) is skipped.
set -u
part=${1:?part: one or long}
out=${2:?output folder}
deadline=${3:-100000}
mkdir -p "$out"
day=$(date -u +%F)
py=${PYTHON:-python3}

source "$(dirname "${BASH_SOURCE[0]}")/steps.sh"

before=(TILEPD_FP8_PF_AHEAD=0 TILEPD_MOE_FUSED_GATE_ROUTE_ROWS=0)
case "$part" in
  one)
    step fp8-prefetch 150 "$py" bench/fp8_gemv_sweep.py --prefetch --out "$out/fp8-prefetch_h200_${day}.json"
    pf=$("$py" -c "import json,sys; d=json.load(open(sys.argv[1])); s=d['summed_us']; print(min(s, key=lambda a: s[a]))" \
      "$out/fp8-prefetch_h200_${day}.json" 2>/dev/null || echo 2)
    echo "== prefetch distance for the runs below: $pf"
    both=(TILEPD_FP8_PF_AHEAD="$pf" TILEPD_MOE_FUSED_GATE_ROUTE_ROWS=1)
    step moe-fused 120 env "${both[@]}" "$py" bench/moe_fused_gpu.py --trials 4 --no-sweep --out "$out/moe-fused-gpu_h200_${day}-rows.json"
    step glm-1k-before 120 env "${before[@]}" bash -c "$(model_fns); glm before 1024"
    step glm-1k-both 120 env "${both[@]}" bash -c "$(model_fns); glm both 1024"
    step parity 200 env "${both[@]}" "$py" -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_dsa_gpu_parity.py \
      tests/engine/test_mla_gpu_parity.py tests/engine/test_fp8_gpu_parity.py
    step glm-1k-rows 120 env TILEPD_FP8_PF_AHEAD=0 TILEPD_MOE_FUSED_GATE_ROUTE_ROWS=1 bash -c "$(model_fns); glm rows 1024"
    step glm-1k-pf 120 env TILEPD_FP8_PF_AHEAD="$pf" TILEPD_MOE_FUSED_GATE_ROUTE_ROWS=0 bash -c "$(model_fns); glm pf 1024"
    step tp8-before 100 env "${before[@]}" bash -c "$(model_fns); tp8 before"
    step tp8-both 100 env "${both[@]}" bash -c "$(model_fns); tp8 both"
    step dsv3-before 110 env "${before[@]}" bash -c "$(model_fns); dsv3 before"
    step dsv3-both 110 env "${both[@]}" bash -c "$(model_fns); dsv3 both"
    ;;
  long)
    pf=${4:?prefetch distance}
    both=(TILEPD_FP8_PF_AHEAD="$pf" TILEPD_MOE_FUSED_GATE_ROUTE_ROWS=1)
    step glm-long-both 300 env "${both[@]}" bash -c "$(model_fns); glm both 32768 131072 200000"
    step glm-bf16 150 env "${both[@]}" "$py" bench/decode_speed.py --model glm-5.1 --no-hf --no-mtp --variants speed-path \
      --contexts 1024 --tokens 64 --json --out "$out/glm-5.1_bf16_78L_decode_speed_${day}.json"
    step llama 120 env "${both[@]}" "$py" bench/decode_speed.py --model llama3-8b --no-hf --variants speed-path --contexts 1024 8192 \
      --tokens 128 --json --out "$out/llama3-8b_bf16_decode_speed_${day}.json"
    ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
