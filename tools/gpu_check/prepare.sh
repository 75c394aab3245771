#!/usr/bin/env bash
# Prepare the GPU check where the package registries are reachable (this machine, not the GPU one).
#
#   tools/gpu_check/prepare.sh [MEGATRON_LM_DIR]
#
# Writes into the ignored folder .gpu/ at the repository root:
#   .gpu/wheels/            what a bare CUDA machine (Python 3.12, its own PyTorch 2.11) lacks:
#                           deepspeed built as a wheel with no ops, megatron-core's cp312 manylinux
#                           wheel, pydantic (+ its core, cp312 manylinux), hjson and the rest, each
#                           at the version constraints.txt pins; no torch (the machine's own is used);
#                           torchao and bitsandbytes (CUDA 13 libraries only) for the optimizer step
#   .gpu/megatron-lm.tar.gz Megatron-LM core_v0.19.0 (pretrain_gpt.py, its builders and its own megatron/
#                           package, megatron-core 0.19's sources: run.sh puts them first on the path,
#                           ahead of the 0.16.1 wheel the other steps use) with
#                           patches/megatron-lm-core_v0.19.0.patch applied, when a clone is given (a
#                           work tree or a bare repository); without one the Megatron-LM step of run.sh
#                           is skipped and says so
#   .gpu/data/              tinyshakespeare.txt from ../shared/data, for converge.sh, where present
#   .gpu/MANIFEST.txt       what was prepared, with sha256 sums (run.sh --dry-run checks them)
# Then, on the GPU machine: tools/gpu_check/run.sh (carry .gpu); rehearse it first here with
# tools/gpu_check/run.sh --rehearse. Exit status 0 on success.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="$root/.gpu"
py="${PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
pin() {  # the version constraints.txt pins for a package
    sed -n "s/^$1==\(.*\)$/\1/Ip" "$root/constraints.txt"
}
need_pin() {
    local v; v="$(pin "$1")"
    [ -n "$v" ] || { echo "prepare.sh: $1 is not pinned in constraints.txt" >&2; exit 1; }
    echo "$1==$v"
}
rm -rf "$out"
mkdir -p "$out/wheels"

# 1. deepspeed as a pure-Python wheel: no op is built here (the GPU machine JIT-builds what it uses;
#    the configs of run.sh use torch_adam, so none is needed).
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$out/wheels" "$(need_pin deepspeed)"

# 2. binary wheels for CPython 3.12 on manylinux x86-64 (the GPU machine's interpreter).
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
binary=("$(need_pin megatron-core)" "$(need_pin pydantic_core)")
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d "$out/wheels" "${binary[@]}"

# 3. pure-Python packages the image lacks (its package list: /work/.library/device/KINDS.md).
pure=("$(need_pin pydantic)" "$(need_pin annotated-types)" "$(need_pin typing-inspection)" "$(need_pin hjson)"
      "$(need_pin typing_extensions)")
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$out/wheels" "${pure[@]}"

# 4. the optimizer peers the GPU check times ours against (optional: run.sh runs without them):
#    torchao (abi3), and bitsandbytes with only its CPU and CUDA 13 libraries (the image's CUDA; the
#    whole wheel, 43 MB, would leave little of the 64 MiB a device call carries).
peers=("$(need_pin torchao)" "$(need_pin bitsandbytes)")
if "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" --platform manylinux_2_24_x86_64 -d "$out/wheels" "${peers[@]}"; then
    bnb="$(ls "$out"/wheels/bitsandbytes-*.whl)"
    slim="$(mktemp -d)"
    (cd "$slim" && unzip -q "$bnb" && find bitsandbytes -name 'libbitsandbytes_*.so' \
        ! -name '*_cpu.so' ! -name '*_cuda13*.so' -delete && rm "$bnb" && zip -q -r "$bnb" .)
    rm -rf "$slim"
else
    echo "prepare.sh: torchao/bitsandbytes not downloaded; the GPU check's optimizer step leaves them out"
fi

# 5. Megatron-LM at the commit the core_v0.18+ patch is pinned to (core_v0.19.0), patched.
patch="$root/patches/megatron-lm-core_v0.19.0.patch"
commit="$(sed -n 's/^Pinned: .*commit \([0-9a-f]\{40\}\).*/\1/p' "$patch")"
if [ $# -ge 1 ]; then
    repo="$1"
    git -C "$repo" rev-parse --verify -q "$commit^{commit}" >/dev/null \
        || { echo "prepare.sh: $repo has no commit $commit (fetch tag core_v0.19.0)" >&2; exit 1; }
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    mkdir "$tmp/megatron-lm"
    git -C "$repo" archive "$commit" pretrain_gpt.py gpt_builders.py model_provider.py megatron \
        | tar -x -C "$tmp/megatron-lm"
    (cd "$tmp/megatron-lm" && patch -s -p1 <"$patch")
    echo "$commit" >"$tmp/megatron-lm/XIRANG_PINNED_COMMIT"
    tar -czf "$out/megatron-lm.tar.gz" -C "$tmp" megatron-lm
else
    echo "prepare.sh: no Megatron-LM clone given; run.sh will skip pretrain_gpt.py (pass a clone to include it)"
fi

# 6. the corpus converge.sh trains on, where the shared folder beside the checkout has it (the device
#    carries only the checkout; without it the stdlib's docstrings are the data).
if [ -f "$root/../shared/data/tinyshakespeare.txt" ]; then
    mkdir -p "$out/data" && cp "$root/../shared/data/tinyshakespeare.txt" "$out/data/"
fi

(cd "$out" && find . -type f ! -name MANIFEST.txt -print0 | sort -z | xargs -0 sha256sum) >"$out/MANIFEST.txt"
echo "prepared $out ($(du -sh "$out" | cut -f1)):"
sed 's/^/  /' "$out/MANIFEST.txt"
