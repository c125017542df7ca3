#!/usr/bin/env bash
# Issue 24's long-context DSA rows on one GPU in one device call: the indexer kernels' parity and times at GLM-5.1
# shapes (32K / 128K / 200K, tile sweep), the same bench on a "before" tree if one is given, DeepGEMM's fp8 MQA logits
# beside the scores kernel when its wheel is given, then GLM-5.1 fp8 at 78 layers through decode_speed.py.
#
#   bash bench/dsa_long_context.sh OUTDIR [BEFORE_TREE] [DEEPGEMM_WHEEL]
#
# Each step writes its JSON and log under OUTDIR and prints how long it took; a failed step does not stop the next.
set -u
out=${1:?output folder}
before=${2:-}
wheel=${3:-}
mkdir -p "$out"
day=$(date -u +%F)
py=${PYTHON:-python3}

step() {  # step NAME SECONDS CMD...: one bench under a time limit, its log beside its JSON
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 6 "$out/$name.log" | cut -c1-400
}

"$py" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
lengths="32768 131072 202752"
step dsa-kernels 95 "$py" bench/dsa_kernels.py --lengths $lengths --sweep --out "$out/dsa-kernels_h200_$day.json"
if [ -n "$before" ]; then
  step dsa-kernels-before 45 bash -c "cd '$before' && '$py' bench/dsa_kernels.py --lengths $lengths --out '$out/dsa-kernels-before_h200_$day.json'"
fi
step decode-speed 65 "$py" bench/decode_speed.py --model glm-5.1 --weights fp8 --no-hf --no-mtp --variants speed-path \
  --contexts 32768 131072 200000 --tokens 32 --json --out "$out/glm-5.1_fp8_78L_decode_speed_$day-dsa2.json"
if [ -n "$wheel" ]; then
  "$py" -m pip install --no-deps --no-index --target /tmp/deepgemm "$wheel" > "$out/deepgemm-install.log" 2>&1 || echo "deep_gemm: install failed"
  step deepgemm 30 "$py" bench/dsa_deepgemm_logits.py --wheel-dir /tmp/deepgemm --out "$out/dsa-deepgemm_h200_$day.json"
fi
if [ -n "$before" ]; then
  step decode-speed-before 40 bash -c "cd '$before' && '$py' bench/decode_speed.py --model glm-5.1 --weights fp8 --no-hf --no-mtp \
    --variants speed-path --contexts 32768 131072 200000 --tokens 32 --json --out '$out/glm-5.1_fp8_78L_decode_speed_$day-before.json'"
fi
"$py" - "$out" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("dsa-kernels*.json")):
    d = json.loads(f.read_text())
    print(f.name, "read GB/s", d.get("read_GBps"), "all_pass", d.get("all_pass"))
    for r in d.get("rows", []):
        print(f"  L={r['L']:>6} scores {r.get('scores_kernel_us')} us (floor {r.get('keys_read_floor_us')}, "
              f"{r.get('scores_keys_pct_of_read_bw')}%) select {r.get('topk_select_us')} index_topk {r.get('index_topk_us')} us / "
              f"{r.get('index_topk_launches')} launches, kernels path {r.get('kernels_us')} us / {r.get('kernels_launches')}, pass {r.get('pass')}")
for f in sorted(out.glob("glm-5.1*.json")):
    d = json.loads(f.read_text())
    for r in d.get("rows", []):
        print(f.name, r.get("context"), "ms/token", round(r.get("ms_per_token") or 0, 3), "% floor", round(r.get("pct_of_floor") or 0, 1),
              "launches/layer", r.get("launches_per_layer"), "non-GEMV us/layer", round(r.get("non_gemv_us_per_layer") or 0, 1))
EOF
