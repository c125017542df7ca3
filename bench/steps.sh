# Sourced by the device-call scripts (pdl_step.sh, depth_step.sh): one timed step, the GPU parity step, and issue 24's model rows.
# The caller sets out (folder), day (date tag), py (python) and deadline (seconds from its start; 100000: none).
# gpu: the card's tag in result names (h200, h100), so a run on whichever card came is named for it.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep -o 'H[0-9]\+' | tr 'H' 'h')
gpu=${gpu:-gpu}

step() {  # step NAME SECONDS CMD...: one bench under a time limit (and the deadline), its log beside its JSON
  local name=$1 limit=$2; shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 20 ]; then echo "== $name: skipped (deadline)"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  echo "== $name: $*"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 12 "$out/$name.log"
}

glm() {  # glm TAG CONTEXTS...: GLM-5.1 fp8 at 78 layers, speed path, profiled
  local tag=$1; shift
  "$py" bench/decode_speed.py --model glm-5.1 --weights fp8 --no-hf --no-mtp --variants speed-path --contexts "$@" --tokens 64 \
    --json --out "$out/glm-5.1_fp8_78L_decode_speed_${gpu}_${day}-${tag}.json"
}

dsv3() {  # dsv3 TAG [CONTEXTS...]: DeepSeek-V3 fp8 at 61 layers (default 1K)
  local tag=$1; shift
  [ $# -gt 0 ] || set -- 1024
  "$py" bench/decode_speed.py --model deepseek-v3 --weights fp8 --no-hf --no-mtp --variants speed-path --contexts "$@" --tokens 64 \
    --json --out "$out/deepseek-v3_fp8_61L_decode_speed_${gpu}_${day}-${tag}.json"
}

tp8() {  # tp8 TAG [ARGS...]: one TP8 rank's shard of GLM-5.1 fp8 (ARGS: tp_shard_step.py's; default --contexts 1024 131072)
  local tag=$1; shift
  [ $# -gt 0 ] || set -- --contexts 1024 131072
  "$py" bench/tp_shard_step.py "$@" --tokens 128 --json --out "$out/tp-shard-step_glm51_fp8_tp8_${gpu}_${day}-${tag}.json"
}

llama() {  # llama TAG [CONTEXTS...]: llama3-8b bf16, speed path (default 1K and 8K)
  local tag=$1; shift
  [ $# -gt 0 ] || set -- 1024 8192
  "$py" bench/decode_speed.py --model llama3-8b --no-hf --variants speed-path --contexts "$@" --tokens 128 \
    --json --out "$out/llama3-8b_bf16_decode_speed_${gpu}_${day}-${tag}.json"
}

parity() {  # parity NAME SECONDS [VAR=VALUE...]: the GPU parity files (DSA, MLA, fp8, the TP8 shard's fused MoE), under the settings given
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" env "$@" "$py" -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_dsa_gpu_parity.py \
    tests/engine/test_mla_gpu_parity.py tests/engine/test_fp8_gpu_parity.py tests/engine/test_tp_shard_step.py tests/engine/test_mla_core_gpu.py
}

# a step runs one of the model functions under its own env: step NAME S env VAR=... bash -c "$(model_fns); glm TAG 1024"
model_fns() {
  echo "$(declare -f glm dsv3 tp8 llama); py=$py out=$out day=$day gpu=$gpu"
}

bundle() {  # bundle: $out as one $out.tgz (the folder removed), since a device call brings back at most 8 files
  tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && rm -rf "$out"
}
