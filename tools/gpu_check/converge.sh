#!/usr/bin/env bash
# The GPU check's second script, for when device time remains after run.sh: 300 optimizer steps of the
# 162M GPT (gpt:layers=12,hidden=768,heads=12,seq=256,vocab=50304) on one GPU, plain DeepSpeed and each
# preset under its budget (bench_side.py's fractions of plain's peak), one process per side. Every
# step's loss and time is appended to results.jsonl as it happens, each side's peaks at its end, so a
# side cut by its limit keeps its curve. The convergence figure this CPU cannot afford (about 2 hours
# of both cores per side).
#
#   tools/gpu_check/converge.sh [--rehearse] [RESULTS_DIR]      (after run.sh, on the same machine)
#
# It reuses run.sh's install when one is there, else installs the same way. --rehearse: 6 steps of a
# tiny GPT on this CPU. `python tools/gpu_check/summarize.py RESULTS_DIR` reads the peaks and final losses.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
kit="$root/tools/gpu_check"
mode=gpu
[ "${1:-}" = --rehearse ] && { mode=rehearse; shift; }
if [ "$mode" = rehearse ]; then
    results="${1:-/tmp/xirang-gpu-converge}"
    py="${PYTHON:-$( [ -x "$root/.venv/bin/python" ] && echo "$root/.venv/bin/python" || echo python3)}"
    model="gpt:layers=2,hidden=64,heads=2,seq=32,vocab=256"; steps=6; limit=60
else
    results="${1:-${OUT:-$root/benchmarks/results/gpu/$(date +%Y%m%d)-converge}}"
    py="${PYTHON:-python3}"
    model="gpt:layers=12,hidden=768,heads=12,seq=256,vocab=50304"; steps=300; limit=120
fi
work="${XIRANG_GPU_WORK:-/tmp/xirang-gpu-work-$mode}"
site="$work/site"
data=()
[ -f "$root/.gpu/data/tinyshakespeare.txt" ] && data=(--data "$root/.gpu/data/tinyshakespeare.txt")
mkdir -p "$results" "$work" || exit 1
exec > >(tee -a "$results/converge.log") 2>&1
if [ ! -f "$site/xirang_ds/__init__.py" ]; then
    echo "no install in $site: running run.sh's install step first"
    wheels=(); [ "$mode" = gpu ] && wheels=("$root"/.gpu/wheels/*.whl)
    mkdir -p "$work/src" "$work/dist" && cp -r "$root"/{setup.py,README.md,xirang_ds,plugins} "$work/src/" \
        && "$py" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir -w "$work/dist" "$work/src" \
        && "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
            "${wheels[@]}" "$work"/dist/xirang_ds-*.whl || exit 1
fi
export PYTHONPATH="$site:$kit" PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore DS_BUILD_OPS=0
cd "$work" || exit 1
status=0
for side in plain conservative balanced aggressive; do
    echo "== $side ($steps steps, limit $limit s)"
    timeout --kill-after=5 "$limit" "$py" "$kit/bench_side.py" --side "$side" --model "$model" --warmup 0 \
        --steps "$steps" --micro-batch 8 --no-counts "${data[@]}" --jsonl "$results/results.jsonl" \
        | grep -v "^\[xirang\]" | tail -2
    rc=${PIPESTATUS[0]}
    echo "== $side: exit $rc"
    [ "$rc" = 0 ] || status=1
done
exit "$status"
