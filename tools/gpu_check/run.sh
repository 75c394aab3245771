#!/usr/bin/env bash
# The GPU check, on a bare CUDA machine (Python 3.12 and its own PyTorch, no network), from the
# wheels tools/gpu_check/prepare.sh put in .gpu/. Steps in order of value, each under its own limit
# (420 s in all, within a 480 s deadline; a step that would start too late is skipped and says so):
#   install   20 s  .gpu/wheels and a wheel built from this tree, into a private folder
#   imports   15 s  the machine's versions; every plugin imported from that folder, never the checkout
#   bench    185 s  a GPT of 0.91B parameters in bf16 on one GPU: plain DeepSpeed (50 s), then each preset
#                   under a fraction of plain's peak (45 s each), one process per side
#   optimizer 45 s  the optimizer step alone: torch's fused AdamW, DynamicAdamW's formats eager and fused,
#                   torchao and bitsandbytes, on the tensors of the Megatron model below (134M parameters)
#   megatron  80 s  Megatron-LM core_v0.19.0's pretrain_gpt.py (megatron-core 0.19 from its own tree),
#                   patched with patches/megatron-lm-core_v0.19.0.patch, 10 iterations on --mock-data, plain
#                   then with the block (40 s each)
#   pytest    75 s  pytest -m gpu, one process, from a copy of tests/ outside the checkout
# Results are kept as they come (JSON Lines, appended and synced as each side, round or test ends)
# in RESULTS_DIR (default: $OUT where the device tool sets it, else benchmarks/results/gpu/<date>):
# run.log, results.jsonl (imports, bench sides and their steps, optimizer rounds, tests), pytest.log,
# megatron_plain.log and megatron_xirang.log: five files (the device tool brings back at most eight).
# `python tools/gpu_check/summarize.py RESULTS_DIR` reads them, whole or cut short.
#
#   tools/gpu_check/run.sh [--dry-run | --rehearse] [RESULTS_DIR]
#
# --dry-run checks the prepared wheels (names and sha256 sums against .gpu/MANIFEST.txt) and prints
# the plan with its time limits on any machine; exit status 1 when something is missing.
# --rehearse runs every step with the same scripts on this machine's CPU (tiny shapes, gloo), with
# this interpreter's packages in place of .gpu/wheels and the tree built and installed the same way;
# the Megatron step runs megatron-core's own loop (examples/megatron_gpt.py, TP=2) in place of
# Megatron-LM's, which needs CUDA. Exit status 1 when any step fails. CI runs it
# (tests/tools/test_gpu_check.py).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
kit="$root/tools/gpu_check"
gpu="${XIRANG_GPU_DIR:-$root/.gpu}"  # what prepare.sh wrote
mode=gpu
case "${1:-}" in
    --dry-run) mode=dry; shift ;;
    --rehearse) mode=rehearse; shift ;;
esac
if [ "$mode" = rehearse ]; then
    results="${1:-/tmp/xirang-gpu-rehearsal}"
    py="${PYTHON:-$( [ -x "$root/.venv/bin/python" ] && echo "$root/.venv/bin/python" || echo python3)}"
else
    results="${1:-${OUT:-$root/benchmarks/results/gpu/$(date +%Y%m%d)}}"
    py="${PYTHON:-python3}"
fi
work="${XIRANG_GPU_WORK:-/tmp/xirang-gpu-work-$mode}"  # every step runs here: the checkout is not on any path
site="$work/site"
deadline_s=480
required=(deepspeed megatron_core pydantic pydantic_core annotated_types typing_inspection hjson typing_extensions)
gpu_tests=$(cd "$root" && grep -l "mark.gpu" tests/*/test_*.py | tr '\n' ' ')
if [ "$mode" = rehearse ]; then
    model="gpt:layers=2,hidden=64,heads=2,seq=32,vocab=256"
    opt_shapes="256x64,64,64x64,64"
    megatron_args=(--steps 4 --world-size 2)
else
    model="gpt:layers=16,hidden=2048,heads=16,seq=1024,vocab=50304"   # 0.91B parameters
    opt_shapes="32000x1024"  # pretrain_gpt.py's model below: embedding, then 8 layers' weights, biases and norms
    for _ in 1 2 3 4 5 6 7 8; do opt_shapes+=",3072x1024,3072,1024x1024,1024,4096x1024,4096,1024x4096,1024,1024,1024"; done
    megatron_args=(--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
        --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 4 --train-iters 10
        --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0
        --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --bf16 --transformer-impl local
        --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-persist-layer-norm
        --eval-iters 0 --eval-interval 1000000 --log-interval 1 --num-workers 0 --seed 1234)
fi
presets=(conservative balanced aggressive)

plan() {
    cat <<EOF
GPU check plan ($mode; deadline ${deadline_s} s, step limits 420 s in all; results in $results):
  install   20 s  pip --no-index --no-deps --target $site: .gpu/wheels/*.whl and a wheel of this tree
  imports   15 s  versions and every plugin, imported from $site -> results.jsonl
  bench    185 s  tools/gpu_check/bench_side.py --model $model: plain (50 s), ${presets[*]} (45 s each), a process each -> results.jsonl
  optimizer 45 s  benchmarks/optimizer_states_compare.py --counts (torch fused AdamW, DynamicAdamW, torchao, bitsandbytes) -> results.jsonl
  megatron  80 s  pretrain_gpt.py core_v0.19.0 (patched, .gpu/megatron-lm.tar.gz) plain, then --xirang-config tools/gpu_check/megatron_xirang.json (40 s each) -> megatron_{plain,xirang}.log
  pytest    75 s  $py -m pytest -m gpu $gpu_tests -> results.jsonl, pytest.log
EOF
}

check_wheels() {
    local missing=0 name
    if [ ! -f "$gpu/MANIFEST.txt" ]; then
        echo "missing: $gpu/MANIFEST.txt (run tools/gpu_check/prepare.sh where the registries are reachable)"
        return 1
    fi
    for name in "${required[@]}"; do
        if ! ls "$gpu/wheels/${name}"-*.whl >/dev/null 2>&1; then
            echo "missing wheel: $name (run tools/gpu_check/prepare.sh)"; missing=1
        fi
    done
    if ! (cd "$gpu" && sha256sum --quiet -c MANIFEST.txt); then
        echo "a prepared file does not match .gpu/MANIFEST.txt (run tools/gpu_check/prepare.sh again)"; missing=1
    fi
    [ -f "$gpu/megatron-lm.tar.gz" ] || echo "note: no .gpu/megatron-lm.tar.gz: the pretrain_gpt.py steps will be skipped"
    return "$missing"
}

if [ "$mode" = dry ]; then
    plan
    echo "interpreter: $($py -c 'import sys; print(sys.version.split()[0])' 2>&1)" \
         "(the GPU machine has 3.12; the binary wheels are cp312)"
    if check_wheels; then echo "wheels: all ${#required[@]} present and matching"; exit 0; fi
    exit 1
fi

rm -rf "$work" && mkdir -p "$work" "$results" || exit 1
records="$results/results.jsonl"
log="$results/run.log"
start=$(date +%s)
exec > >(tee -a "$log") 2>&1
plan
if [ "$mode" = gpu ]; then
    check_wheels || { echo "cannot run: prepare .gpu/ first"; exit 1; }
else
    echo "rehearsal: $py ($($py -c 'import sys; print(sys.version.split()[0])')) with its own packages in place of .gpu/wheels"
fi

# step NAME LIMIT_S COMMAND...: runs COMMAND under min(LIMIT_S, time left before the deadline)
status=0
step() {
    local name="$1" limit="$2"; shift 2
    local left=$(( deadline_s - ($(date +%s) - start) ))
    if [ "$left" -lt 15 ]; then
        echo "== $name: skipped (${left} s left before the deadline)"; status=1
        "$py" -c 'import json, sys; open(sys.argv[1], "a").write(json.dumps({"kind": "skipped", "step": sys.argv[2]}) + "\n")' \
            "$records" "$name"
        return
    fi
    [ "$limit" -le "$left" ] || limit="$left"
    echo "== $name (limit ${limit} s, $(( $(date +%s) - start )) s elapsed)"
    limit_s="$limit"  # a shell function applies it to its own commands (timeout cannot run a function)
    if declare -F "$1" >/dev/null; then "$@"; else timeout --kill-after=5 "$limit" "$@"; fi
    local rc=$?
    echo "== $name: exit $rc after $(( $(date +%s) - start )) s"
    [ "$rc" = 0 ] || status=1
}

install() {  # a copy of the tree built as a wheel (nothing written into the checkout), installed with the prepared wheels: what a user's pip install gives
    local wheels=()
    [ "$mode" = gpu ] && wheels=("$gpu"/wheels/*.whl)
    mkdir -p "$work/src" "$work/dist" && cp -r "$root"/{setup.py,README.md,xirang_ds,plugins} "$work/src/" \
        && timeout "$limit_s" "$py" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir -w "$work/dist" "$work/src" \
        && timeout "$limit_s" "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
            "${wheels[@]}" "$work"/dist/xirang_ds-*.whl
}
step install 20 install
# The private folder first, the kit's scripts next; PYTHONSAFEPATH keeps the current directory and a
# script's folder off sys.path in every process (the 2026-12-04 run's fork server took the checkout's
# xirang_ds from its working directory), and every step runs in $work, outside the checkout.
export PYTHONPATH="$site:$kit" PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore DS_BUILD_OPS=0
cd "$work" || exit 1

step imports 15 "$py" "$kit/imports.py" "$records" "$site"

side_limit() { [ "$1" = plain ] && echo 50 || echo 45; }
for side in plain "${presets[@]}"; do
    step "bench $side" "$(side_limit "$side")" "$py" "$kit/bench_side.py" --side "$side" --model "$model" --jsonl "$records"
done

device=cuda; [ "$mode" = rehearse ] && device=cpu
step optimizer 45 "$py" "$root/benchmarks/optimizer_states_compare.py" --device "$device" --shapes "$opt_shapes" \
    --rounds 10 --deadline-s 30 --counts --jsonl "$records"

megatron_rehearsal() {  # LOG [ARGS...]: megatron-core's loop (TP=2, gloo) from a copy outside the checkout
    local out="$1"; shift
    mkdir -p "$work/megatron/examples" "$work/megatron/tests/harness"
    cp "$root/examples/megatron_gpt.py" "$work/megatron/examples/"
    cp "$root/tests/__init__.py" "$work/megatron/tests/"
    cp "$root/tests/harness/__init__.py" "$root/tests/harness/megatron_shim.py" "$work/megatron/tests/harness/"
    local name="${out##*/megatron_}"; name="${name%.log}"
    timeout --kill-after=5 "$limit_s" "$py" "$work/megatron/examples/megatron_gpt.py" "${megatron_args[@]}" "$@" \
        --json "$work/megatron_$name.json" >"$out" 2>&1
    local rc=$?
    tail -5 "$out"
    [ "$rc" = 0 ] && "$py" -c 'import json, sys
from xirang_ds.bench import append_jsonl
append_jsonl(sys.argv[1], {"kind": "megatron_standin", "side": sys.argv[2], "ranks": json.load(open(sys.argv[3]))})' \
        "$records" "$name" "$work/megatron_$name.json"
    return "$rc"
}
if [ "$mode" = rehearse ]; then
    step megatron_plain 40 megatron_rehearsal "$results/megatron_plain.log"
    step megatron_xirang 40 megatron_rehearsal "$results/megatron_xirang.log" --xirang-config "$kit/megatron_xirang.json"
elif [ -f "$gpu/megatron-lm.tar.gz" ]; then
    mkdir -p "$work/megatron-lm" && tar -xzf "$gpu/megatron-lm.tar.gz" -C "$work"
    meg="$work/megatron-lm"
    # Megatron-LM runs `make` in megatron/core/datasets at start (its C++ index helpers): use the
    # megatron-core wheel's prebuilt library (helpers.cpp and the Makefile are the same blobs at
    # core_v0.16.1 and core_v0.19.0: 1f58761, 16f251b), newer than helpers.cpp so make has nothing to
    # do, and a python3-config that names its suffix where the image has none (make would build another name).
    datasets="$meg/megatron/core/datasets"
    cp "$site"/megatron/core/datasets/helpers_cpp*.so "$datasets"/ 2>/dev/null && touch "$datasets"/helpers_cpp*.so
    if ! command -v python3-config >/dev/null; then
        mkdir -p "$work/bin"
        printf '#!/bin/sh\nexec %s -c "import sysconfig; print(sysconfig.get_config_var(\\"EXT_SUFFIX\\"))"\n' \
            "$(command -v "$py")" >"$work/bin/python3-config"
        chmod +x "$work/bin/python3-config"
        export PATH="$work/bin:$PATH"
    fi
    pretrain() {  # pretrain LOG [ARGS...]: one rank, the tree's own megatron/ package first on the path
        local out="$1"; shift
        (cd "$meg" && PYTHONPATH="$meg:$site" CUDA_DEVICE_MAX_CONNECTIONS=1 timeout --kill-after=5 "$limit_s" \
            "$py" -m torch.distributed.run \
            --nproc_per_node 1 --master_port 29517 "$meg/pretrain_gpt.py" "${megatron_args[@]}" "$@") >"$out" 2>&1
        local rc=$?
        grep -E "iteration +[0-9]+/|memory \(MB\)|Error|error:" "$out" | tail -15
        return "$rc"
    }
    step megatron_plain 40 pretrain "$results/megatron_plain.log"
    step megatron_xirang 40 pretrain "$results/megatron_xirang.log" --xirang-config "$kit/megatron_xirang.json"
else
    echo "== megatron: skipped (no .gpu/megatron-lm.tar.gz: pass a Megatron-LM clone to prepare.sh)"
    status=1
fi

gpu_pytest() {  # the gpu tests from a copy outside the checkout, so they import the installed package
    mkdir -p "$work/pytest" && cp -r "$root/tests" "$root/pytest.ini" "$work/pytest/" || return 1
    # shellcheck disable=SC2086
    (cd "$work/pytest" && XIRANG_GPU_RECORDS="$records" XIRANG_GPU_SITE="$site" PYTHONPATH="$PYTHONPATH:$work/pytest" \
        timeout --kill-after=5 "$limit_s" "$py" -m pytest -p pytest_records -p no:cacheprovider -m gpu -q -rA \
        $gpu_tests) >"$results/pytest.log" 2>&1
    local rc=$?
    tail -15 "$results/pytest.log"
    return "$rc"
}
step pytest 75 gpu_pytest

echo "GPU check done in $(( $(date +%s) - start )) s, status $status; results in $results"
exit "$status"
