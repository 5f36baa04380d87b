#!/usr/bin/env bash
# The GPU checks of TESTING.md in one command: the test suite on the GPU machine, the four
# compute-sanitizer tools over every GPU test (initcheck without the kernel filter), the long
# property profile against the CUDA kernels and a soak. Installs nothing: install the package
# first (TESTING.md has the command). Run from anywhere; it works in the repository root.
#
# Each part runs in its own process under `timeout` (its budget); a part's failure does not
# stop the others. One summary line per part goes to stdout and to LOG_DIR/summary.txt; the
# parts' logs go to LOG_DIR/logs.tar.gz (each log cut to its first and last 2 MiB there; the
# whole logs stay in the work folder the summary names). Exit status: 0 when every part
# passed, 1 when one did not, 2 for a usage error or a machine that cannot run the checks.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

PYTHON="${PYTHON:-python3}"
DEFAULT_BUDGET=540          # seconds per part: one device call is limited to 10 minutes
PROPERTY_EXAMPLES=10        # examples per property test in each round of the long profile
SOAK_STEPS=10000
RETRIES=3                   # runs again of a sanitizer part whose process died (resumed: below)
MIN_RETRY_SECONDS=30        # of its budget left, for a run again to start
DRY_RUN=0
PARTS_ARG="all"
LOG_DIR=""
declare -A BUDGET=()

TOOLS=(memcheck racecheck synccheck initcheck)
# Sanitized test groups, one process each (a crash or a timeout loses one group, not a tool).
STORE_FILES=(tests/test_store.py tests/test_edge_values.py tests/test_scales.py
             tests/test_inplace.py tests/test_roundtrip.py tests/test_numerics.py)
DECODE_FILES=(tests/test_decode_kernel.py)
RAGGED_FILES=(tests/test_ragged_attention.py)
SAN_GROUPS=(store decode ragged ragged-cases rest)

all_parts() {
    echo suite-gpu suite-cpu ragged-tile
    local tool group
    for tool in "${TOOLS[@]}"; do
        for group in "${SAN_GROUPS[@]}"; do echo "$tool:$group"; done
    done
    echo properties soak
}

usage() {
    cat <<EOF
Usage: tests/gpu_checks.sh [options]

Runs the GPU checks (TESTING.md, "On a GPU machine: tests/gpu_checks.sh") and prints one
summary line per part: PART PASS|FAIL|TIMEOUT SECONDS DETAILS.

Options:
  --parts LIST        comma-separated parts or groups of parts (default: all):
                        all        every part below
                        suite      suite-gpu, suite-cpu, ragged-tile
                        suite-gpu  pytest -m gpu tests (every GPU test)
                        suite-cpu  pytest -m "not gpu" tests (the rest, on this machine's CPU;
                                   one process per file, up to 8 at once: tests/pytest_shards.py)
                        ragged-tile  the ragged GPU tests with JAX_NVFP4_RAGGED_PIPELINED=0
                                   (the pipelined prefill kernel off: the ragged kernel's
                                   long-sequence path)
                        TOOL       TOOL:store, TOOL:decode, TOOL:ragged, TOOL:ragged-cases,
                                   TOOL:rest, for TOOL in memcheck racecheck synccheck initcheck
                                   (compute-sanitizer --kernel-name kns=nvfp4 over the GPU
                                   tests, one process per group: store = ${STORE_FILES[*]##*/};
                                   decode = ${DECODE_FILES[*]##*/}; ragged = ${RAGGED_FILES[*]##*/};
                                   ragged-cases = tests/ragged_sanitizer_cases.py;
                                   rest = every other GPU test; initcheck runs without
                                   --kernel-name: XLA's kernels instrumented too)
                        sanitizers the four TOOLs
                        properties JAX_NVFP4_HYPOTHESIS=long over the GPU property tests, in
                                   rounds of --property-examples until the budget is spent
                        soak       tests/device_soak.py --device gpu (--soak-steps steps)
  --budget SECONDS    seconds for every part (default $DEFAULT_BUDGET); a part past it is killed
                      (TIMEOUT). --budget PART=SECONDS or TOOL=SECONDS sets one part or a
                      tool's parts; may be repeated.
  --log-dir DIR       where summary.txt and logs.tar.gz go (default: \$OUT/gpu_checks when OUT
                      is set, else /tmp/gpu_checks-DATE)
  --property-examples N  examples per property test per round (default $PROPERTY_EXAMPLES)
  --soak-steps N      soak steps (default $SOAK_STEPS)
  --retries N         run a sanitizer part again, up to N times, when its process died of a
                      signal before the tool's summary (compute-sanitizer itself crashes now
                      and then: TESTING.md), within what is left of its budget (default
                      $RETRIES; 0: never). A pytest part resumes: the next run deselects the
                      tests that passed or skipped in the runs before it (not the failed ones,
                      nor the one that was running); ragged-cases runs whole again. Its summary
                      line names every crash and how many tests each run deselected; each run
                      has its own log, and a report in any run fails the part
  --python PY         the Python to run (default \$PYTHON or python3)
  --dry-run           print "PART<TAB>BUDGET<TAB>COMMAND" for each selected part; run nothing
  --list              print the part names, one a line
  -h, --help          this text

One device call is limited to 10 minutes: give each call parts whose budgets sum to less,
e.g. --parts suite-gpu,soak then --parts memcheck (TESTING.md has the split and times).
EOF
}

die_usage() {
    echo "gpu_checks: $*" >&2
    echo "Try tests/gpu_checks.sh --help" >&2
    exit 2
}

is_count() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }

while (($#)); do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --list) all_parts | tr ' ' '\n'; exit 0 ;;
        --dry-run) DRY_RUN=1 ;;
        --parts|--budget|--log-dir|--property-examples|--soak-steps|--python|--retries)
            (($# >= 2)) && [[ "$2" != --* ]] || die_usage "$1 needs a value"
            case "$1" in
                --parts) PARTS_ARG="$2" ;;
                --log-dir) LOG_DIR="$2" ;;
                --python) PYTHON="$2" ;;
                --property-examples) is_count "$2" || die_usage "--property-examples must be a positive integer, got '$2'"; PROPERTY_EXAMPLES="$2" ;;
                --soak-steps) is_count "$2" || die_usage "--soak-steps must be a positive integer, got '$2'"; SOAK_STEPS="$2" ;;
                --retries) [[ "$2" =~ ^(0|[1-9][0-9]*)$ ]] || die_usage "--retries must be a count (0 or more), got '$2'"; RETRIES="$2" ;;
                --budget)
                    if [[ "$2" == *=* ]]; then
                        is_count "${2#*=}" || die_usage "--budget ${2%%=*}= needs a positive number of seconds, got '${2#*=}'"
                        BUDGET["${2%%=*}"]="${2#*=}"
                    else
                        is_count "$2" || die_usage "--budget must be a positive number of seconds, got '$2'"
                        DEFAULT_BUDGET="$2"
                    fi ;;
            esac
            shift ;;
        *) die_usage "unknown argument '$1'" ;;
    esac
    shift
done

KNOWN=" $(all_parts | tr '\n' ' ') "

# Expand --parts into part names, in the canonical order, each once.
expand() {
    local item="$1" tool group
    case "$item" in
        all) all_parts ;;
        suite) echo suite-gpu suite-cpu ragged-tile ;;
        sanitizers) for tool in "${TOOLS[@]}"; do for group in "${SAN_GROUPS[@]}"; do echo "$tool:$group"; done; done ;;
        memcheck|racecheck|synccheck|initcheck) for group in "${SAN_GROUPS[@]}"; do echo "$item:$group"; done ;;
        *) echo "$item" ;;
    esac
}
GROUP_NAMES=" all suite sanitizers ${TOOLS[*]} "
declare -A WANTED=()
IFS=',' read -r -a ITEMS <<< "$PARTS_ARG"
((${#ITEMS[@]})) || die_usage "--parts is empty"
for item in "${ITEMS[@]}"; do
    [[ -n "$item" ]] || die_usage "--parts has an empty entry: '$PARTS_ARG'"
    # Checked here: expand runs in a subshell, where die_usage would not end the script.
    [[ "$GROUP_NAMES$KNOWN" == *" $item "* ]] || die_usage "unknown part '$item' (see --list)"
    for part in $(expand "$item") ; do WANTED["$part"]=1; done
done
for key in "${!BUDGET[@]}"; do
    [[ "$KNOWN" == *" $key "* || " ${TOOLS[*]} " == *" $key "* ]] \
        || die_usage "--budget names an unknown part '$key'"
done
PARTS=()
for part in $(all_parts); do [[ -n "${WANTED[$part]:-}" ]] && PARTS+=("$part"); done

budget_of() {
    local part="$1"
    echo "${BUDGET[$part]:-${BUDGET[${part%%:*}]:-$DEFAULT_BUDGET}}"
}

# The environment the sanitizers need (TESTING.md): without eager module loading the sanitized
# process crashed a few tests in; JAX would otherwise preallocate most of the GPU; XLA's command
# buffers and autotuning launch work the sanitizers need not see. JAX_NVFP4_SANITIZER tells the
# tests (tests/test_numerics.py: the 2^32-input self-checks run unsanitized in suite-gpu).
sanitizer_env() {
    CMD=(env XLA_PYTHON_CLIENT_PREALLOCATE=false CUDA_MODULE_LOADING=EAGER
         "XLA_FLAGS=--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0"
         "JAX_NVFP4_SANITIZER=$1" "$SANITIZER" --tool "$1" --error-exitcode 99)
}

PYTEST=(-P -m pytest -q -p no:cacheprovider)
# Sanitized tests verbosely: pytest -v writes a test's name when it starts, so a log that ends
# in the middle of one names it. compute-sanitizer itself has died (SIGSEGV, no summary, no
# Python traceback: seventeenth session) where faulthandler cannot say where.
SANITIZED_PYTEST=("${PYTEST[@]/#-q/-v}")
CPU_JOBS="$(nproc 2>/dev/null || echo 1)"
((CPU_JOBS > 8)) && CPU_JOBS=8  # (the tests' own XLA threads share the cores)

# CMD = the command of one part (one process). The properties part runs it in rounds.
command_of() {
    local part="$1" tool="${1%%:*}" group="${1#*:}"
    CMD=()
    case "$part" in
        suite-gpu) CMD=("$PYTHON" "${PYTEST[@]}" -m gpu tests) ;;
        # One pytest process per test file, CPU_JOBS at a time (tests/pytest_shards.py): on
        # one process the CPU suite outgrew a device call (past 533 s at two thirds, under
        # other parts' load, seventeenth session; ~19 min on CI's 2 cores).
        suite-cpu) CMD=("$PYTHON" -P tests/pytest_shards.py --jobs "$CPU_JOBS" "${PYTEST[@]:3}"
                        -m "not gpu" -- tests) ;;
        # The ragged GPU tests again with the pipelined prefill kernel switched off, so that the
        # ragged kernel's own path for long sequences keeps its GPU tests.
        ragged-tile) CMD=(env JAX_NVFP4_RAGGED_PIPELINED=0 "$PYTHON" "${PYTEST[@]}" -m gpu
                          "${RAGGED_FILES[@]}") ;;
        properties) CMD=(env JAX_NVFP4_HYPOTHESIS=long "JAX_NVFP4_HYPOTHESIS_EXAMPLES=$PROPERTY_EXAMPLES"
                         "$PYTHON" "${PYTEST[@]}" -m gpu --hypothesis-show-statistics
                         tests/test_properties.py) ;;
        soak) CMD=("$PYTHON" -P tests/device_soak.py --device gpu --steps "$SOAK_STEPS") ;;
        *)
            sanitizer_env "$tool"
            # compute-sanitizer dies now and then (rc 139, no summary, 0 errors) under the decode
            # kernel's cluster launches: memcheck at a different test of the decode group in
            # every run until it ran without them; racecheck, synccheck and initcheck in the
            # store and rest groups, in 4 of the 5 crashes whose test is known in a test whose
            # ragged calls launch the clusters for their one-token sequences (TESTING.md,
            # seventeenth and eighteenth sessions).
            # Those parts run with the cluster merge switched off (the merge kernel instead): the
            # decode group keeps it sanitized under the other three tools, the ragged groups
            # under all four.
            if [[ "$part" == memcheck:decode || "$group" == store || "$group" == rest ]]; then
                CMD=(env JAX_NVFP4_CLUSTER_MERGE=0 "${CMD[@]:1}")
            fi
            # initcheck runs unfiltered (every kernel instrumented): with the filter it does not
            # see XLA's kernels write the scalars ours read and reports those reads as
            # uninitialized (thousands per group); unfiltered it reports 0 (TESTING.md).
            [[ "$tool" == initcheck ]] || CMD+=(--kernel-name kns=nvfp4)
            case "$group" in
                store) CMD+=("$PYTHON" "${SANITIZED_PYTEST[@]}" -m gpu "${STORE_FILES[@]}") ;;
                decode) CMD+=("$PYTHON" "${SANITIZED_PYTEST[@]}" -m gpu "${DECODE_FILES[@]}") ;;
                ragged) CMD+=("$PYTHON" "${SANITIZED_PYTEST[@]}" -m gpu "${RAGGED_FILES[@]}") ;;
                # (-X faulthandler: a crash's traceback names the case; pytest turns it on itself)
                ragged-cases) CMD+=("$PYTHON" -P -X faulthandler tests/ragged_sanitizer_cases.py) ;;
                rest)
                    CMD+=("$PYTHON" "${SANITIZED_PYTEST[@]}" -m gpu)
                    local f
                    for f in "${STORE_FILES[@]}" "${DECODE_FILES[@]}" "${RAGGED_FILES[@]}"; do
                        CMD+=("--ignore=$f")
                    done
                    CMD+=(tests) ;;
            esac ;;
    esac
}

SANITIZER="$(command -v compute-sanitizer || true)"
[[ -z "$SANITIZER" && -x /usr/local/cuda/bin/compute-sanitizer ]] && SANITIZER=/usr/local/cuda/bin/compute-sanitizer
needs_sanitizer=0
for part in "${PARTS[@]}"; do
    [[ "$part" == *:* ]] && needs_sanitizer=1
done

if ((DRY_RUN)); then
    SANITIZER="${SANITIZER:-compute-sanitizer}"
    for part in "${PARTS[@]}"; do
        command_of "$part"
        printf '%s\t%s\t%s\n' "$part" "$(budget_of "$part")" "$(printf '%q ' "${CMD[@]}" | sed 's/ $//')"
    done
    exit 0
fi

# ------------------------------------------------------------------------------ preflight
# Fail in seconds, not after a part's budget, where the checks cannot run.
PREFLIGHT='
import jax, jax_nvfp4
from jax_nvfp4 import _ffi
try:
    gpus = jax.devices("gpu")
except RuntimeError as error:
    raise SystemExit(f"no GPU visible to JAX ({error})")
if not _ffi.built_with_cuda():
    raise SystemExit("jax_nvfp4 was built without its CUDA kernels (install it with nvcc found)")
print(f"jax {jax.__version__}, {len(gpus)} x {gpus[0].device_kind}, jax_nvfp4 from "
      f"{jax_nvfp4.__file__}")
'
if ! INFO="$(timeout -k 10 180 "$PYTHON" -P -c "$PREFLIGHT" 2>&1)"; then
    echo "gpu_checks: cannot run the GPU checks here: $(echo "$INFO" | tail -n 1)" >&2
    exit 2
fi
INFO="$(echo "$INFO" | tail -n 1)"
if ((needs_sanitizer)) && [[ -z "$SANITIZER" ]]; then
    echo "gpu_checks: compute-sanitizer is neither on PATH nor in /usr/local/cuda/bin" >&2
    exit 2
fi

STAMP="$(date +%Y%m%d-%H%M%S)"
if [[ -z "$LOG_DIR" ]]; then
    if [[ -n "${OUT:-}" ]]; then LOG_DIR="$OUT/gpu_checks"; else LOG_DIR="/tmp/gpu_checks-$STAMP"; fi
fi
mkdir -p "$LOG_DIR" || exit 2
# The whole logs live outside LOG_DIR: the device tool returns at most 8 files from $OUT.
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_checks-work-$STAMP-XXXX")" || exit 2
SUMMARY="$LOG_DIR/summary.txt"
{
    echo "gpu_checks $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo '+changes')"
    echo "$INFO"
    echo "parts: ${PARTS[*]}; whole logs in $WORK"
} | tee "$SUMMARY"

# The last pytest result line of a log ("176 passed, 2 skipped in 160.12s"), if any.
pytest_result() {
    grep -E '^(=+ )?[0-9]+ (passed|failed|error|errors|skipped|deselected)' "$1" | tail -n 1 \
        | sed -E 's/^=+ //; s/ =+$//'
}

FAILED=0
record() {  # part status seconds details
    printf '%-22s %-7s %5ss  %s\n' "$1" "$2" "$3" "$4" | tee -a "$SUMMARY"
    [[ "$2" == PASS ]] || FAILED=1
}

status_of() {  # rc -> PASS / TIMEOUT / FAIL
    case "$1" in
        0) echo PASS ;;
        124|137) echo TIMEOUT ;;
        *) echo FAIL ;;
    esac
}

run_properties() {
    local log="$1" budget="$2" start=$SECONDS longest=0 rounds=0 rc=0 took left
    command_of properties
    while :; do
        left=$((budget - (SECONDS - start)))
        # Another round only if it is likely to finish: twice the longest round so far.
        if ((rounds > 0 && left < 2 * longest + 30)); then break; fi
        local t0=$SECONDS
        echo "### round $((rounds + 1)): $(printf '%q ' "${CMD[@]}")" >> "$log"
        timeout -k 30 "$left" "${CMD[@]}" >> "$log" 2>&1
        rc=$?
        took=$((SECONDS - t0))
        ((took > longest)) && longest=$took
        ((rc == 0)) || break
        rounds=$((rounds + 1))
    done
    local status
    status="$(status_of "$rc")"
    record properties "$status" $((SECONDS - start)) \
        "$rounds rounds passed of $PROPERTY_EXAMPLES examples per test (+ corners), longest round ${longest}s; last: $(pytest_result "$log")"
}

for part in "${PARTS[@]}"; do
    log="$WORK/${part/:/-}.log"
    budget="$(budget_of "$part")"
    echo "### $part (budget ${budget}s) $(date -u +%H:%M:%S)" > "$log"
    if [[ "$part" == properties ]]; then
        run_properties "$log" "$budget"
        continue
    fi
    command_of "$part"
    start=$SECONDS
    attempt=0
    notes=""
    logs=()
    RESUME=()   # --deselect ID for each test that finished in an earlier run of this part
    while :; do
        if ((attempt)); then
            log="$WORK/${part/:/-}.retry$attempt.log"
            echo "### $part, run $((attempt + 1)) $(date -u +%H:%M:%S)" > "$log"
        fi
        logs+=("$log")
        echo "### $(printf '%q ' "${CMD[@]}" "${RESUME[@]}")" >> "$log"
        run_start=$SECONDS
        left=$((budget - (SECONDS - start)))
        if ((left < 1)); then  # (a run again whose budget went to reading the last log)
            echo "### no budget left" >> "$log"
            rc=124
            break
        fi
        timeout -k 30 "$left" "${CMD[@]}" "${RESUME[@]}" >> "$log" 2>&1
        rc=$?
        # A resumed run left nothing to run (every test had finished; the tool died after
        # pytest's end): pytest's exit 5, "no tests ran", is this run's pass.
        if ((rc == 5 && ${#RESUME[@]})); then
            notes+="run $((attempt + 1)) had no test left (pytest's rc=5); "
            rc=0
        fi
        # Died of a signal (not the timeout's: 124, 137) before the tool's summary:
        # compute-sanitizer's own crash (TESTING.md). Run it again; a report it printed before
        # it died still counts (the part's counts cover all its runs).
        if [[ "$part" == *:* ]] && ((rc > 128 && rc != 137 && attempt < RETRIES)) \
                && ((budget - (SECONDS - start) >= MIN_RETRY_SECONDS)); then
            counts="$("$PYTHON" tests/sanitizer_log.py "$log")"
            # (A report before the crash is a finding: the part fails, with no run again.)
            if [[ "$counts" == "errors=0 summaries=0 "* ]]; then
                notes+="run $((attempt + 1)) died: rc=$rc after $((SECONDS - run_start))s, $counts; "
                attempt=$((attempt + 1))
                # A pytest part resumes where it died: the next run deselects the tests that
                # passed or skipped in the runs so far, so that it does not spend its budget
                # redoing them and die again before the end (memcheck:ragged died in all three
                # runs from the start, after 34, 18 and 19 of its 43 tests: TESTING.md).
                # ragged-cases (one script, no pytest) runs whole again.
                if [[ "$part" != *:ragged-cases ]]; then
                    RESUME=()
                    while IFS= read -r test_id; do
                        [[ -n "$test_id" ]] && RESUME+=(--deselect "$test_id")
                    done < <("$PYTHON" tests/sanitizer_log.py --finished "${logs[@]}")
                    notes+="run $((attempt + 1)) resumed: $((${#RESUME[@]} / 2)) finished tests"
                    notes+=" deselected; "
                fi
                continue
            fi
        fi
        break
    done
    seconds=$((SECONDS - start))
    status="$(status_of "$rc")"
    case "$part" in
        soak) details="$(grep '^soak: ' "$log" | tail -n 1)" ;;
        ragged-cases|*:ragged-cases) details="$(grep '^worst ' "$log" | tail -n 1)" ;;
        *) details="$(pytest_result "$log")" ;;
    esac
    # A resumed run's result line counts the tests it was left only: the tally over all runs'
    # logs (each test once, at its last outcome) says the whole.
    if ((${#RESUME[@]})); then
        tally="$("$PYTHON" tests/sanitizer_log.py --tally "${logs[@]}")"
        details="last run: ${details:-no result line in its log}; all runs: ${tally:-no test outcome}"
    fi
    if [[ "$part" == *:* ]]; then
        counts="$("$PYTHON" tests/sanitizer_log.py "${logs[@]}")"
        last="$counts"
        ((${#logs[@]} > 1)) && last="$("$PYTHON" tests/sanitizer_log.py "$log")"
        # A sanitizer part passes when the tests passed and the tool reported nothing in any
        # of its runs; no summary line in the last run means it did not finish.
        if [[ "$status" == PASS && ( "$counts" != errors=0\ * || "$last" == *summaries=0\ * ) ]]; then
            status=FAIL
        fi
        ((rc == 99)) && details="sanitizer reported errors; $details"
        details="$counts${details:+; $details}"
    fi
    record "$part" "$status" "$seconds" "rc=$rc; ${notes}${details:-no result line in the log}"
done

# Compact logs for LOG_DIR: each cut to its first and last 2 MiB (where the tools' summaries
# are), then one tar.gz.
CUT="$WORK/cut"
mkdir -p "$CUT"
for log in "$WORK"/*.log; do
    [[ -e "$log" ]] || continue
    if (($(stat -c %s "$log") > 4 * 1024 * 1024)); then
        { head -c 2M "$log"; printf '\n### [cut: %s bytes in all]\n' "$(stat -c %s "$log")"; tail -c 2M "$log"; } > "$CUT/${log##*/}"
    else
        cp "$log" "$CUT/"
    fi
done
tar -C "$CUT" -czf "$LOG_DIR/logs.tar.gz" . || echo "gpu_checks: could not write $LOG_DIR/logs.tar.gz" >&2
echo "summary: $SUMMARY; logs: $LOG_DIR/logs.tar.gz" | tee -a "$SUMMARY"
exit "$FAILED"
