#!/usr/bin/env bash
# Kernel variants against the tree in one lease of a GPU machine (benchmarks/NOTES.md: a
# variant is kept only when it measures faster than the default in the same run):
#
#   benchmarks/ab.sh --patch benchmarks/variants/X.patch [--rounds 2] -- COMMAND [ARGS...]
#   benchmarks/ab.sh --arm X.patch --arm Y.patch --arm X.patch,Y.patch -- COMMAND  (B, C, D)
#
# builds the tree as A (installed as TESTING.md's command does) and a copy of the package's
# sources (ffi/, jax_nvfp4/, the build files) with the patches applied as B (beside it: pip
# install --target AB_DIR/B), then runs COMMAND alternately under A and B (A B A B ... for
# --rounds rounds), each run under a "== A, round 1" header with its wall time; B's runs have
# PYTHONPATH=AB_DIR/B, so that `import jax_nvfp4` is B's. The environment passes through to
# every run (set XLA or JAX_NVFP4 switches before the command). Run from anywhere: patch paths
# are the caller's, the command runs in the repository root. Before the runs it checks that A's
# runs import jax_nvfp4 from outside AB_DIR and B's from AB_DIR/B.
#
# Arms: several variants against one A in one device call (A's build and runs are paid once).
# Each --arm FILE[,FILE...] adds an arm built from the tree plus those patches (in order),
# labelled B, C, D, ... in the order given (C, D, ... when --patch defines B); at most 8 (B to
# I). Every arm is built before any run, the runs go A B C ... in each round, and arm X (C, D,
# ...) lives in AB_DIR/tree-x, AB_DIR/build-x and AB_DIR/X (its runs: PYTHONPATH=AB_DIR/X),
# its build log in AB_DIR/build-x.log; B keeps AB_DIR/tree, build-b, B and build-b.log.
#
# --dry-run prints the steps and runs nothing; --check applies every arm's patches to a copy of
# the tree and stops. --a installed takes the jax_nvfp4 already installed as A (no build: the
# tree was installed by TESTING.md's command in the same lease); --a none runs the arms alone
# (a variant that instruments, whose command A cannot run). Exit status: 0 when the builds and
# every run succeeded, 1 when one did not, 2 for a usage error or a patch that does not apply.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
ARCH=90a-real               # the H200 (sm_90a: the pipelined prefill kernel's wgmma)
ROUNDS=2
AB_DIR="$(realpath -m "${AB_DIR:-/tmp/ab}")"  # (absolute: the builds and runs change folder)
PATCHES=()                  # --patch: arm B's
ARM_OPT_PATCHES=()          # --arm: every patch named, in order, and the --arm it came from
ARM_OPT_OF=()               # (0 for the first --arm)
N_ARM_OPTS=0
DRY_RUN=0
CHECK=0
A_MODE=build                # build | installed | none
LABELS=(B C D E F G H I)    # the arms' names: at most 8

die_usage() {
    echo "ab: $*" >&2
    echo "Usage: benchmarks/ab.sh {--patch FILE | --arm FILE[,FILE...]}... [--rounds N]" \
         "[--arch ARCH] [--a build|installed|none] [--dry-run | --check] -- COMMAND [ARGS...]" >&2
    exit 2
}

absolute() { echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"; }

while (($#)); do
    case "$1" in
        --patch|--arm|--rounds|--arch|--a)
            (($# >= 2)) || die_usage "$1 needs a value"
            case "$1" in
                --patch) [[ -f "$2" ]] || die_usage "no patch file '$2'"
                         PATCHES+=("$(absolute "$2")") ;;
                --arm) rest="$2,"    # (a file per comma, none empty)
                       while [[ -n "$rest" ]]; do
                           file="${rest%%,*}"
                           rest="${rest#*,}"
                           [[ -n "$file" ]] || die_usage "--arm '$2' names an empty patch file"
                           [[ -f "$file" ]] || die_usage "no patch file '$file' (--arm '$2')"
                           ARM_OPT_PATCHES+=("$(absolute "$file")")
                           ARM_OPT_OF+=("$N_ARM_OPTS")
                       done
                       ((++N_ARM_OPTS)) ;;
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
# The arms: B from --patch where given, then one per --arm. Arm k's patches are the ALL_PATCHES
# whose ALL_OF is k, in order.
FIRST_ARM_OPT=$(( ${#PATCHES[@]} ? 1 : 0 ))
N_ARMS=$(( FIRST_ARM_OPT + N_ARM_OPTS ))
((N_ARMS)) || die_usage "no --patch or --arm: B would be A"
((N_ARMS <= ${#LABELS[@]})) \
    || die_usage "$N_ARMS arms: at most ${#LABELS[@]} (B to ${LABELS[-1]}) in one call"
((CHECK || $#)) || die_usage "no command after --"
cd "$ROOT" || exit 2
ALL_PATCHES=() ALL_OF=()
for patch in ${PATCHES[@]+"${PATCHES[@]}"}; do ALL_PATCHES+=("$patch"); ALL_OF+=(0); done
for ((i = 0; i < ${#ARM_OPT_PATCHES[@]}; ++i)); do
    ALL_PATCHES+=("${ARM_OPT_PATCHES[i]}"); ALL_OF+=($(( ARM_OPT_OF[i] + FIRST_ARM_OPT )))
done
ARMS=("${LABELS[@]:0:N_ARMS}")
ARM_TREE=() ARM_BUILD=() ARM_TARGET=() ARM_LOG=()
for ((k = 0; k < N_ARMS; ++k)); do
    x="${ARMS[k],,}"
    if ((k == 0)); then ARM_TREE+=("$AB_DIR/tree"); else ARM_TREE+=("$AB_DIR/tree-$x"); fi
    ARM_BUILD+=("$AB_DIR/build-$x") ARM_TARGET+=("$AB_DIR/${ARMS[k]}") ARM_LOG+=("$AB_DIR/build-$x.log")
done
arm_patches() {  # arm k's patches, in order, into ARM_PATCHES
    ARM_PATCHES=()
    local i
    for ((i = 0; i < ${#ALL_PATCHES[@]}; ++i)); do
        ((ALL_OF[i] == $1)) && ARM_PATCHES+=("${ALL_PATCHES[i]}")
    done
    return 0
}

PIP=("$PYTHON" -m pip install -q --no-build-isolation --no-deps
     "--config-settings=cmake.define.JAX_NVFP4_CUDA_ARCHITECTURES=$ARCH")

# What the package is built from (pyproject.toml), patched: an arm is only built from it (the
# runs happen here, the arm imported by PYTHONPATH), so a patch may touch these alone.
BUILD_INPUTS=(pyproject.toml CMakeLists.txt README.md ffi jax_nvfp4)
make_tree() {  # arm k's tree
    # (and its build folder: tar keeps the files' times, so a file an earlier patch changed
    # would come back older than its object and not be compiled again)
    local tree="${ARM_TREE[$1]}" patch
    rm -rf "$tree" "${ARM_BUILD[$1]}" && mkdir -p "$tree" || return 2
    tar -C "$ROOT" --exclude=__pycache__ -cf - "${BUILD_INPUTS[@]}" | tar -C "$tree" -xf - || return 2
    arm_patches "$1"
    for patch in "${ARM_PATCHES[@]}"; do
        # git apply outside any repository (none is found above AB_DIR: inside one it would
        # skip paths outside the current folder silently); patch(1) where git is missing,
        # without fuzz (by default it ignores a hunk's first and last context lines).
        if ! (cd "$tree" && if command -v git > /dev/null; then
                  GIT_CEILING_DIRECTORIES="$AB_DIR" git apply "$patch"
              else
                  patch -p1 --forward --batch --quiet --fuzz=0 < "$patch"
              fi); then
            echo "ab: $patch does not apply to the tree (arm ${ARMS[$1]})" >&2
            return 2
        fi
        echo "ab: applied $patch (arm ${ARMS[$1]})"
    done
}

SIDES=(A "${ARMS[@]}")
[[ "$A_MODE" == none ]] && SIDES=("${ARMS[@]}")
if ((DRY_RUN)); then
    case "$A_MODE" in
        build) echo "build A: ${PIP[*]} --config-settings=build-dir=$AB_DIR/build-a ." ;;
        installed) echo "build A: none (A is the jax_nvfp4 installed)" ;;
        none) echo "build A: none (no A runs)" ;;
    esac
    for ((k = 0; k < N_ARMS; ++k)); do
        arm_patches "$k"
        echo "tree ${ARMS[k]}: ${ARM_TREE[k]} = this tree's ${BUILD_INPUTS[*]} + ${ARM_PATCHES[*]}"
        echo "build ${ARMS[k]}: (cd ${ARM_TREE[k]} && ${PIP[*]} --config-settings=build-dir=${ARM_BUILD[k]} --target ${ARM_TARGET[k]} .)"
    done
    for ((round = 1; round <= ROUNDS; ++round)); do
        for side in "${SIDES[@]}"; do
            if [[ "$side" == A ]]; then echo "run A, round $round: $*"
            else echo "run $side, round $round: PYTHONPATH=$AB_DIR/$side $*"; fi
        done
    done
    exit 0
fi
for ((k = 0; k < N_ARMS; ++k)); do make_tree "$k" || exit 2; done
if ((CHECK)); then
    trees=""
    for ((k = 0; k < N_ARMS; ++k)); do trees+="${trees:+; }tree ${ARMS[k]} in ${ARM_TREE[k]}"; done
    echo "ab: the patches apply ($trees)"
    exit 0
fi

FAILED=0
start=$SECONDS
if [[ "$A_MODE" == build ]]; then
    "${PIP[@]}" "--config-settings=build-dir=$AB_DIR/build-a" . > "$AB_DIR/build-a.log" 2>&1 \
        || { echo "ab: build A failed ($AB_DIR/build-a.log):"; tail -n 20 "$AB_DIR/build-a.log"; exit 1; }
    echo "ab: built A in $((SECONDS - start)) s"
fi
for ((k = 0; k < N_ARMS; ++k)); do
    start=$SECONDS
    rm -rf "${ARM_TARGET[k]}"
    (cd "${ARM_TREE[k]}" && "${PIP[@]}" "--config-settings=build-dir=${ARM_BUILD[k]}" \
        --target "${ARM_TARGET[k]}" .) > "${ARM_LOG[k]}" 2>&1 \
        || { echo "ab: build ${ARMS[k]} failed (${ARM_LOG[k]}):"; tail -n 20 "${ARM_LOG[k]}"; exit 1; }
    echo "ab: built ${ARMS[k]} in $((SECONDS - start)) s"
done

# Which jax_nvfp4 each side's runs import (the caller's PYTHONPATH is kept, after the arm's
# folder).
IMPORTED='import jax_nvfp4; print(jax_nvfp4.__file__)'
a_file="$("$PYTHON" -P -c "$IMPORTED" 2>&1 | tail -n 1)"
imports="ab: A imports $a_file"
arm_files=()
for ((k = 0; k < N_ARMS; ++k)); do
    arm_files+=("$(PYTHONPATH="${ARM_TARGET[k]}${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -P -c "$IMPORTED" 2>&1 | tail -n 1)")
    imports+="; ${ARMS[k]} imports ${arm_files[k]}"
done
echo "$imports"
if [[ "$A_MODE" != none && ( "$a_file" != /*/jax_nvfp4/__init__.py || "$a_file" == "$AB_DIR"/* ) ]]; then
    echo "ab: A's runs do not import the installed build" >&2; exit 1
fi
for ((k = 0; k < N_ARMS; ++k)); do
    if [[ "${arm_files[k]}" != "${ARM_TARGET[k]}/jax_nvfp4/__init__.py" ]]; then
        echo "ab: ${ARMS[k]}'s runs do not import ${ARM_TARGET[k]}" >&2; exit 1
    fi
done

for ((round = 1; round <= ROUNDS; ++round)); do
    for side in "${SIDES[@]}"; do
        echo "== $side, round $round"
        start=$SECONDS
        if [[ "$side" == A ]]; then
            "$@"
        else
            PYTHONPATH="$AB_DIR/$side${PYTHONPATH:+:$PYTHONPATH}" "$@"
        fi
        rc=$?
        echo "== $side, round $round: exit $rc, $((SECONDS - start)) s"
        ((rc == 0)) || FAILED=1
    done
done
exit "$FAILED"
