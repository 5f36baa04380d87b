#!/usr/bin/env bash
# A kernel variant against the tree in one lease of a GPU machine (benchmarks/NOTES.md: a
# variant is kept only when it measures faster than the default in the same run):
#
#   benchmarks/ab.sh --patch benchmarks/variants/X.patch [--rounds 2] -- COMMAND [ARGS...]
#
# builds the tree as A (installed as TESTING.md's command does) and a copy of the package's
# sources (ffi/, jax_nvfp4/, the build files) with the patches applied as B (beside it: pip
# install --target AB_DIR/B), then runs COMMAND alternately under A and B (A B A B ... for
# --rounds rounds), each run under a "== A, round 1" header with its wall time; B's runs have PYTHONPATH=AB_DIR/B, so that `import jax_nvfp4` is B's. The environment
# passes through to every run (set XLA or JAX_NVFP4 switches before the command). Run from
# anywhere: patch paths are the caller's, the command runs in the repository root. Before the
# runs it checks that A's runs import jax_nvfp4 from outside AB_DIR and B's from AB_DIR/B.
# --dry-run prints the steps and runs nothing; --check applies the patches to a copy of the
# tree and stops. --a installed takes the jax_nvfp4 already installed as A (no build: the tree
# was installed by TESTING.md's command in the same lease); --a none runs B alone (a variant
# that instruments, whose command A cannot run). Exit status: 0 when the builds and every run
# succeeded, 1 when one did not, 2 for a usage error or a patch that does not apply.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
ARCH=90a-real               # the H200 (sm_90a: the pipelined prefill kernel's wgmma)
ROUNDS=2
AB_DIR="$(realpath -m "${AB_DIR:-/tmp/ab}")"  # (absolute: the builds and runs change folder)
PATCHES=()
DRY_RUN=0
CHECK=0
A_MODE=build                # build | installed | none

die_usage() {
    echo "ab: $*" >&2
    echo "Usage: benchmarks/ab.sh --patch FILE [--patch FILE]... [--rounds N] [--arch ARCH]" \
         "[--a build|installed|none] [--dry-run | --check] -- COMMAND [ARGS...]" >&2
    exit 2
}

while (($#)); do
    case "$1" in
        --patch|--rounds|--arch|--a)
            (($# >= 2)) || die_usage "$1 needs a value"
            case "$1" in
                --patch) [[ -f "$2" ]] || die_usage "no patch file '$2'"
                         PATCHES+=("$(cd "$(dirname "$2")" && pwd)/$(basename "$2")") ;;
                --rounds) [[ "$2" =~ ^[1-9][0-9]*$ ]] || die_usage "--rounds must be a positive integer, got '$2'"
                          ROUNDS="$2" ;;
                --arch) ARCH="$2" ;;
                --a) [[ "$2" =~ ^(build|installed|none)$ ]] || die_usage "--a must be build, installed or none, got '$2'"
                     A_MODE="$2" ;;
            esac
            shift ;;
        --dry-run) DRY_RUN=1 ;;
        --check) CHECK=1 ;;
        --) shift; break ;;
        *) die_usage "unknown argument '$1' (the command goes after --)" ;;
    esac
    shift
done
((${#PATCHES[@]})) || die_usage "no --patch: B would be A"
((CHECK || $#)) || die_usage "no command after --"
cd "$ROOT" || exit 2

PIP=("$PYTHON" -m pip install -q --no-build-isolation --no-deps
     "--config-settings=cmake.define.JAX_NVFP4_CUDA_ARCHITECTURES=$ARCH")

# What the package is built from (pyproject.toml), patched: B is only built from it (the runs
# happen here, B imported by PYTHONPATH), so a patch may touch these alone.
BUILD_INPUTS=(pyproject.toml CMakeLists.txt README.md ffi jax_nvfp4)
make_b_tree() {
    # (and B's build folder: tar keeps the files' times, so a file an earlier patch changed
    # would come back older than its object and not be compiled again)
    rm -rf "$AB_DIR/tree" "$AB_DIR/build-b" && mkdir -p "$AB_DIR/tree" || return 2
    tar -C "$ROOT" --exclude=__pycache__ -cf - "${BUILD_INPUTS[@]}" \
        | tar -C "$AB_DIR/tree" -xf - || return 2
    local patch
    for patch in "${PATCHES[@]}"; do
        # git apply outside any repository (none is found above AB_DIR: inside one it would
        # skip paths outside the current folder silently); patch(1) where git is missing,
        # without fuzz (by default it ignores a hunk's first and last context lines).
        if ! (cd "$AB_DIR/tree" && if command -v git > /dev/null; then
                  GIT_CEILING_DIRECTORIES="$AB_DIR" git apply "$patch"
              else
                  patch -p1 --forward --batch --quiet --fuzz=0 < "$patch"
              fi); then
            echo "ab: $patch does not apply to the tree" >&2
            return 2
        fi
        echo "ab: applied $patch"
    done
}

SIDES=(A B)
[[ "$A_MODE" == none ]] && SIDES=(B)
if ((DRY_RUN)); then
    case "$A_MODE" in
        build) echo "build A: ${PIP[*]} --config-settings=build-dir=$AB_DIR/build-a ." ;;
        installed) echo "build A: none (A is the jax_nvfp4 installed)" ;;
        none) echo "build A: none (no A runs)" ;;
    esac
    echo "tree B: $AB_DIR/tree = this tree's ${BUILD_INPUTS[*]} + ${PATCHES[*]}"
    echo "build B: (cd $AB_DIR/tree && ${PIP[*]} --config-settings=build-dir=$AB_DIR/build-b --target $AB_DIR/B .)"
    for ((round = 1; round <= ROUNDS; ++round)); do
        for side in "${SIDES[@]}"; do
            if [[ "$side" == A ]]; then echo "run A, round $round: $*"
            else echo "run B, round $round: PYTHONPATH=$AB_DIR/B $*"; fi
        done
    done
    exit 0
fi
make_b_tree || exit 2
((CHECK)) && { echo "ab: the patches apply (tree B in $AB_DIR/tree)"; exit 0; }

FAILED=0
start=$SECONDS
if [[ "$A_MODE" == build ]]; then
    "${PIP[@]}" "--config-settings=build-dir=$AB_DIR/build-a" . > "$AB_DIR/build-a.log" 2>&1 \
        || { echo "ab: build A failed ($AB_DIR/build-a.log):"; tail -n 20 "$AB_DIR/build-a.log"; exit 1; }
    echo "ab: built A in $((SECONDS - start)) s"
fi
start=$SECONDS
rm -rf "$AB_DIR/B"
(cd "$AB_DIR/tree" && "${PIP[@]}" "--config-settings=build-dir=$AB_DIR/build-b" \
    --target "$AB_DIR/B" .) > "$AB_DIR/build-b.log" 2>&1 \
    || { echo "ab: build B failed ($AB_DIR/build-b.log):"; tail -n 20 "$AB_DIR/build-b.log"; exit 1; }
echo "ab: built B in $((SECONDS - start)) s"

# Which jax_nvfp4 each side's runs import (the caller's PYTHONPATH is kept, after B's folder).
IMPORTED='import jax_nvfp4; print(jax_nvfp4.__file__)'
a_file="$("$PYTHON" -P -c "$IMPORTED" 2>&1 | tail -n 1)"
b_file="$(PYTHONPATH="$AB_DIR/B${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -P -c "$IMPORTED" 2>&1 | tail -n 1)"
echo "ab: A imports $a_file; B imports $b_file"
if [[ "$A_MODE" != none && ( "$a_file" != /*/jax_nvfp4/__init__.py || "$a_file" == "$AB_DIR"/* ) ]]; then
    echo "ab: A's runs do not import the installed build" >&2; exit 1
fi
if [[ "$b_file" != "$AB_DIR/B/jax_nvfp4/__init__.py" ]]; then
    echo "ab: B's runs do not import $AB_DIR/B" >&2; exit 1
fi

for ((round = 1; round <= ROUNDS; ++round)); do
    for side in "${SIDES[@]}"; do
        echo "== $side, round $round"
        start=$SECONDS
        if [[ "$side" == A ]]; then
            "$@"
        else
            PYTHONPATH="$AB_DIR/B${PYTHONPATH:+:$PYTHONPATH}" "$@"
        fi
        rc=$?
        echo "== $side, round $round: exit $rc, $((SECONDS - start)) s"
        ((rc == 0)) || FAILED=1
    done
done
exit "$FAILED"
