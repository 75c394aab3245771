#!/usr/bin/env bash
# Check that the xirang_ds patch applies to Megatron-LM, without touching the checkout.
#
#   patches/check.sh [-p PATCH] MEGATRON_LM_DIR [REF...]
#
# PATCH is one of patches/*.patch (default megatron-lm-core_v0.16.1.patch, for core_v0.16-0.17;
# megatron-lm-core_v0.19.0.patch is for core_v0.18, 0.19 and main). MEGATRON_LM_DIR is a Megatron-LM
# clone (a work tree or a bare repository). Each REF (default: the commit pinned in the patch header)
# is read into a temporary index and checked with `git apply --cached --check --unidiff-zero`;
# nothing is checked out and the clone is not modified.
# Exit status: 0 when the patch applies at every REF, 1 otherwise, 2 on bad usage.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
patch="$here/megatron-lm-core_v0.16.1.patch"
if [ "${1:-}" = "-p" ]; then
    [ $# -ge 2 ] || { echo "usage: $0 [-p PATCH] MEGATRON_LM_DIR [REF...]" >&2; exit 2; }
    patch="$2"; shift 2
    [ -f "$patch" ] || patch="$here/$patch"
    if [ ! -f "$patch" ]; then
        echo "$0: no patch $patch; the patches are: $(cd "$here" && ls ./*.patch | tr '\n' ' ')" >&2
        exit 2
    fi
fi
pin="$(sed -n 's/^Pinned: .*commit \([0-9a-f]\{40\}\).*/\1/p' "$patch")"
if [ $# -lt 1 ] || ! git -C "$1" rev-parse --git-dir >/dev/null 2>&1; then
    echo "usage: $0 [-p PATCH] MEGATRON_LM_DIR [REF...]   (a Megatron-LM git clone; default REF: $pin)" >&2
    exit 2
fi
repo="$1"; shift
[ $# -gt 0 ] || set -- "$pin"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
status=0
for ref in "$@"; do
    if ! commit="$(git -C "$repo" rev-parse --verify -q "$ref^{commit}")"; then
        echo "$ref: not found in $repo (fetch it: git -C $repo fetch origin $ref)"
        status=1
        continue
    fi
    index="$tmp/index"
    rm -f "$index"
    GIT_INDEX_FILE="$index" git -C "$repo" read-tree "$commit"
    if GIT_INDEX_FILE="$index" git -C "$repo" apply --cached --check --unidiff-zero "$patch" 2>"$tmp/err"; then
        echo "$ref ($commit): applies"
    else
        echo "$ref ($commit): does not apply: $(tr '\n' ' ' <"$tmp/err")"
        status=1
    fi
done
exit "$status"
