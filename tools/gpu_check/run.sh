#!/usr/bin/env bash
# The GPU check, on a bare CUDA machine (Python 3.12 and its own PyTorch, no network), from the
# wheels tools/gpu_check/prepare.sh put in .gpu/. Within 8 minutes in all:
#   1. installs .gpu/wheels and this tree into a private folder (no network, the machine's torch)
#   2. pytest -m gpu (the test files that hold gpu tests)
#   3. the optimizer step alone: torch AdamW against DynamicAdamW's formats, eager and fused, on the
#      tensors of the Megatron model of step 5 (134M parameters)
#   4. the bench: a GPT of about 1B parameters in bf16 on one GPU, plain DeepSpeed and each preset
#   5. Megatron-LM's pretrain_gpt.py, patched, 10 iterations on --mock-data, without and with the block
# Each step has its own time limit and the whole run a deadline; a step that would start too late is
# skipped and says so. Results (JSON and logs, at most 8 files) go to RESULTS_DIR (default: $OUT
# where the device tool sets it, else benchmarks/results/gpu/<date>).
#
#   tools/gpu_check/run.sh [--dry-run] [RESULTS_DIR]
#
# --dry-run checks the prepared wheels (names and sha256 sums against .gpu/MANIFEST.txt) and prints
# the plan with its time limits on any machine; exit status 1 when something is missing.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
gpu="${XIRANG_GPU_DIR:-$root/.gpu}"  # what prepare.sh wrote
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
results="${1:-${OUT:-$root/benchmarks/results/gpu/$(date +%Y%m%d)}}"
py="${PYTHON:-python3}"
site="${XIRANG_GPU_SITE:-/tmp/xirang-gpu-site}"
deadline_s=470
model="gpt:layers=16,hidden=2048,heads=16,seq=1024,vocab=50304"   # 0.91B parameters
required=(deepspeed megatron_core pydantic pydantic_core annotated_types typing_inspection hjson typing_extensions)
gpu_tests=$(cd "$root" && grep -l "mark.gpu" tests/*/test_*.py | tr '\n' ' ')
megatron_args=(--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
    --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 4 --train-iters 10
    --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0
    --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --bf16 --transformer-impl local
    --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-persist-layer-norm
    --eval-iters 0 --eval-interval 1000000 --log-interval 1 --num-workers 0 --seed 1234)

plan() {
    cat <<EOF
GPU check plan (deadline ${deadline_s} s; results in $results):
  install  60 s   pip --no-index --no-deps --target $site: .gpu/wheels/*.whl, then this tree
  env      20 s   torch, CUDA, GPU, deepspeed, megatron-core, xirang_ds versions -> env.json
  pytest  100 s   $py -m pytest -m gpu $gpu_tests -> pytest.log, pytest.xml
  optimizer 65 s  benchmarks/optimizer_states_compare.py --device cuda (the Megatron model's tensors; torchao and
                  bitsandbytes too where prepared) -> optimizer.json
  bench   190 s   tools/gpu_check/bench_presets.py --model $model (plain, conservative, balanced, aggressive) -> bench.json
  megatron 45 s   pretrain_gpt.py (patched, .gpu/megatron-lm.tar.gz) ${megatron_args[*]} -> megatron_plain.log
  megatron 45 s   the same with --xirang-config tools/gpu_check/megatron_xirang.json -> megatron_xirang.log
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

if [ "$dry" = 1 ]; then
    plan
    echo "interpreter: $($py -c 'import sys; print(sys.version.split()[0])' 2>&1)" \
         "(the GPU machine has 3.12; the binary wheels are cp312)"
    if check_wheels; then echo "wheels: all ${#required[@]} present and matching"; exit 0; fi
    exit 1
fi

mkdir -p "$results"
log="$results/run.log"
start=$(date +%s)
exec > >(tee -a "$log") 2>&1
plan
check_wheels || { echo "cannot run: prepare .gpu/ first"; exit 1; }

# step NAME LIMIT_S COMMAND...: runs COMMAND under min(LIMIT_S, time left before the deadline)
status=0
step() {
    local name="$1" limit="$2"; shift 2
    local left=$(( deadline_s - ($(date +%s) - start) ))
    if [ "$left" -lt 15 ]; then echo "== $name: skipped (${left} s left before the deadline)"; status=1; return; fi
    [ "$limit" -le "$left" ] || limit="$left"
    echo "== $name (limit ${limit} s, $(( $(date +%s) - start )) s elapsed)"
    limit_s="$limit"  # a shell function applies it to its own commands (timeout cannot run a function)
    if declare -F "$1" >/dev/null; then "$@"; else timeout --kill-after=5 "$limit" "$@"; fi
    local rc=$?
    echo "== $name: exit $rc after $(( $(date +%s) - start )) s"
    [ "$rc" = 0 ] || status=1
}

install() {
    rm -rf "$site" && mkdir -p "$site" || return 1
    timeout "$limit_s" "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "$gpu"/wheels/*.whl || return 1
    timeout "$limit_s" "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir \
        --target "$site" "$root"
}
step install 60 install
export PYTHONPATH="$site" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
# deepspeed JIT-builds nothing here: the configs use torch_adam and gloo-free NCCL collectives
export DS_BUILD_OPS=0

step env 20 "$py" - "$results/env.json" <<'EOF'
import json, sys, torch
info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_memory_bytes=p.total_memory, capability=f"{p.major}.{p.minor}")
for name in ("deepspeed", "megatron.core", "xirang_ds", "pydantic"):
    try:
        mod = __import__(name, fromlist=["__version__"])
        info[name] = getattr(mod, "__version__", "?")
    except Exception as e:
        info[name] = f"import failed: {type(e).__name__}: {e}"
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info, indent=2))
EOF

# shellcheck disable=SC2086
step pytest 100 bash -c "cd '$root' && '$py' -m pytest -m gpu -p no:cacheprovider -q -rA \
    --junitxml '$results/pytest.xml' $gpu_tests > '$results/pytest.log' 2>&1; rc=\$?; tail -25 '$results/pytest.log'; exit \$rc"

opt_shapes="32000x1024"  # pretrain_gpt.py's model below: embedding, then 8 layers' weights, biases and norms
for _ in 1 2 3 4 5 6 7 8; do opt_shapes+=",3072x1024,3072,1024x1024,1024,4096x1024,4096,1024x4096,1024,1024,1024"; done
step optimizer 65 "$py" "$root/benchmarks/optimizer_states_compare.py" --device cuda --shapes "$opt_shapes" \
    --rounds 10 --deadline-s 50 --json "$results/optimizer.json"

step bench 190 "$py" "$root/tools/gpu_check/bench_presets.py" --model "$model" --steps 6 \
    --json "$results/bench.json" --deadline-s 150

if [ -f "$gpu/megatron-lm.tar.gz" ]; then
    rm -rf /tmp/xirang-megatron-lm && mkdir -p /tmp/xirang-megatron-lm \
        && tar -xzf "$gpu/megatron-lm.tar.gz" -C /tmp/xirang-megatron-lm
    meg=/tmp/xirang-megatron-lm/megatron-lm
    # Megatron-LM runs `make` in megatron/core/datasets at start (its C++ index helpers): use the
    # megatron-core wheel's prebuilt library, newer than helpers.cpp so make has nothing to do, and a
    # python3-config that names its suffix where the image has none (make would build another name).
    datasets="$meg/megatron/core/datasets"
    cp "$site"/megatron/core/datasets/helpers_cpp*.so "$datasets"/ 2>/dev/null && touch "$datasets"/helpers_cpp*.so
    if ! command -v python3-config >/dev/null; then
        mkdir -p /tmp/xirang-bin
        printf '#!/bin/sh\nexec %s -c "import sysconfig; print(sysconfig.get_config_var(\\"EXT_SUFFIX\\"))"\n' \
            "$(command -v "$py")" >/tmp/xirang-bin/python3-config
        chmod +x /tmp/xirang-bin/python3-config
        export PATH="/tmp/xirang-bin:$PATH"
    fi
    pretrain() {  # pretrain LOG [ARGS...]: one rank, the tree's own megatron/ package first on the path
        local out="$1"; shift
        (cd "$meg" && PYTHONPATH="$meg:$site" CUDA_DEVICE_MAX_CONNECTIONS=1 timeout --kill-after=5 "$limit_s" \
            "$py" -m torch.distributed.run \
            --nproc_per_node 1 --master_port 29517 pretrain_gpt.py "${megatron_args[@]}" "$@") >"$out" 2>&1
        local rc=$?
        grep -E "iteration +[0-9]+/|memory \(MB\)|Error|error:" "$out" | tail -15
        return "$rc"
    }
    step megatron_plain 45 pretrain "$results/megatron_plain.log"
    step megatron_xirang 45 pretrain "$results/megatron_xirang.log" --xirang-config "$root/tools/gpu_check/megatron_xirang.json"
else
    echo "== megatron: skipped (no .gpu/megatron-lm.tar.gz: pass a Megatron-LM clone to prepare.sh)"
    status=1
fi
echo "GPU check done in $(( $(date +%s) - start )) s, status $status; results in $results"
exit "$status"
