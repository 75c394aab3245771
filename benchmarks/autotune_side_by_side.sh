#!/usr/bin/env bash
# DeepSpeed's autotuner and `xirang-ds tune` on the same model and ds_config, one after the other,
# on this machine (docs/autotune.md). DeepSpeed's autotuner needs `tabulate` (pip) and `pdsh` (apt:
# it launches every experiment through pdsh, even on one node) and runs through the deepspeed
# launcher with one "GPU" (the CPU accelerator reports one device).
#
#   benchmarks/autotune_side_by_side.sh [MODEL] [BUDGET]      # default: gpt-tiny 256MiB
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODEL=${1:-gpt-tiny}
BUDGET=${2:-256MiB}
OUT="$ROOT/benchmarks/results/autotune"
WORK=$(mktemp -d)
mkdir -p "$OUT"
export PATH="$ROOT/.venv/bin:$PATH"
cat > "$WORK/ds.json" <<'EOF'
{
  "train_micro_batch_size_per_gpu": 4,
  "bf16": {"enabled": true},
  "zero_optimization": {"stage": 2},
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": true}},
  "autotuning": {"enabled": true, "fast": true, "arg_mappings": {}}
}
EOF
python - "$WORK/ds.json" "$WORK/ours.json" <<'EOF'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg.pop("autotuning")
cfg["xirang"] = {"autotune": {"enabled": True, "objective": "largest_micro_batch", "measure_top": 3}}
json.dump(cfg, open(sys.argv[2], "w"), indent=1)
EOF
cd "$WORK"
start=$(date +%s)
deepspeed --autotuning tune --num_gpus 1 "$ROOT/examples/train_gpt.py" --deepspeed_config "$WORK/ds.json" \
    --model "$MODEL" --steps 10 > "$OUT/deepspeed_autotuner.log" 2>&1 || echo "deepspeed autotuner exited with $?"
echo "deepspeed autotuner: $(( $(date +%s) - start )) s" | tee "$OUT/times.txt"
cp autotuning_results/summary.txt "$OUT/deepspeed_summary.txt" 2>/dev/null || true
cp autotuning_results/ds_config_optimal.json "$OUT/deepspeed_optimal.json" 2>/dev/null || true
if [ -f "$OUT/deepspeed_optimal.json" ]; then  # the peak of DeepSpeed's pick, measured here (3 steps)
    python - "$OUT/deepspeed_optimal.json" "$WORK/ds_pick.json" <<'EOF2'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg.pop("autotuning", None)
json.dump(cfg, open(sys.argv[2], "w"))
EOF2
    xirang-ds estimate --model "$MODEL" --ds-config "$WORK/ds_pick.json" --calibrate \
        --json "$OUT/deepspeed_pick_measured.json" > "$OUT/deepspeed_pick_measured.log" 2>&1 || true
    grep "measured over" "$OUT/deepspeed_pick_measured.log" || true
fi
start=$(date +%s)
xirang-ds tune --model "$MODEL" --ds-config "$WORK/ours.json" --budget "$BUDGET" --out "$OUT/xirang_tuned.json" \
    --json "$OUT/xirang_tune.json" --quiet > "$OUT/xirang_tune.log" 2>&1 || echo "xirang-ds tune exited with $?"
echo "xirang-ds tune: $(( $(date +%s) - start )) s" | tee -a "$OUT/times.txt"
grep -A12 "^tune:" "$OUT/xirang_tune.log" || true
rm -rf "$WORK"
