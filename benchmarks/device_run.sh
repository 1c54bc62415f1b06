#!/usr/bin/env bash
# What a GPU machine runs (benchmarks/README.md). Carry .whl (the wheels the GPU tests need that the
# machine lacks, beartype among them; installed into /tmp/site) and, for the A/B steps, .old/base (a
# `git archive` of the commit to compare with, unpacked); .sglang holds the pinned sglang wheel for the
# steps that compare with sglang. Runs the steps named in $STEPS in order, each logged under $OUT:
#   gpu_fast       the GPU suite less its fuzz files and its two longest tests (15 workers, at most $GPU_FAST_S s;
#                  each test's result as it ends in $OUT/gpu_fast.txt, so a run stopped by its limit says what ran)
#   gpu_fuzz       the fuzz files gpu_fast leaves out (15 workers, at most $GPU_FUZZ_S s): with gpu_fast, the
#                  whole suite less gpu_long
#   gpu_long       the two longest tests (MLA fuzz in production mode, threads in debug mode; 2 workers)
#   gpu_k          the GPU tests of $GPU_K_FILES (default tests) whose names match $GPU_K (pytest -k; 8 workers)
#   gpu_k_trees    gpu_k's selection in each tree of $GPU_K_TREES (copies carried under .old/, e.g. a fix
#                  reverted: its tests must fail there), each against its own package
#   tp             the two-GPU tensor-parallel test (needs a two-GPU machine)
#   memcheck       tests/fuzz_sample.py (30 examples per op and mode) under compute-sanitizer memcheck
#   ws_sanitizer   tests/fused_ws_sample.py plainly (compiling its kernels), then under each of
#                  $WS_SANITIZER_TOOLS (memcheck synccheck) at once, all but memcheck on the warp-specialised
#                  kernel alone, each at most $WS_SANITIZER_S s (300); reports in $OUT/ws_<tool>.txt
#   ws_tests       the warp-specialised kernel's GPU tests (tests/test_gpu_fused_ws.py), then the end-to-end bench
#   sglang         the GPU tests against sglang's own helper, then the end-to-end bench (carry .sglang)
#   mla            the MLA GPU tests, typedkv bench --only MLA, and benchmarks/mla_sweep.py
#   bench          typedkv bench (every section)
#   benchq         typedkv bench --only "$BENCH_ONLY" --no-compare (a subset, no baselines; $BENCH_TOKENS: its T list)
#   e2e            typedkv bench --only e2e (the end-to-end section and the host-time lines)
#   e2e_ab         typedkv bench --only e2e, .old/base and this checkout alternated, $E2E_AB_ROUNDS rounds (2)
#   ab             benchmarks/ab_time.py: .old/base and this checkout alternated, 3 rounds ($AB_ARGS: its flags)
#   fused_sweep    benchmarks/fused_sweep.py ($FUSED_SWEEP_T: its flags and T list; at most $FUSED_SWEEP_S s)
#   fused_ab       benchmarks/fused_sweep.py --defaults (dense, then --pools), .old/base and this checkout
#                  alternated, $FUSED_AB_ROUNDS rounds (3) at $FUSED_AB_T (16 32 48 64); $FUSED_AB_WHERE: dense,
#                  pools or both (default)
#   ws_sweep       benchmarks/ws_sweep.py ($WS_SWEEP_ARGS: its flags and T list; several runs' arguments
#                  separated by "|", each at most $WS_SWEEP_S s)
#   mla_sweep      benchmarks/mla_sweep.py alone (at most $MLA_SWEEP_S s)
#   peer           benchmarks/peer_cases.py: the standalone kernel at the peer-kernel cases ($PEER_ARGS, 2 rounds)
#   peer_design    benchmarks/peer_design.py --check: the standalone kernel against a kernel of the peer's
#                  design, interleaved in one run ($PEER_DESIGN_ARGS: its flags and rounds, default 5)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ROOT=$(pwd)
# One script of benchmarks/, at most LIMIT seconds, its output also in $OUT/NAME.txt:
#   tool NAME SCRIPT LIMIT [ARG ...]
tool() {
    local name=$1 script=$2 limit=$3
    shift 3
    timeout "$limit" env PYTHONPATH="$ROOT:/tmp/site" python3 "benchmarks/$script" "$@" 2>&1 | tee "$OUT/$name.txt"
}
# gpu_k's selection of GPU tests, run in the current directory (its tests against the package on PYTHONPATH).
gpu_k_tests() {
    timeout "${GPU_K_S:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 --ignore=tests/typecheck \
        ${GPU_K_FILES:-tests} -k "${GPU_K:-}" 2>&1 | tail -40
}
e2e() {
    timeout "${FUSED_E2E_S:-200}" python3 -m typedkv bench --only e2e --out "$OUT/e2e" 2>&1 | tail -60 | tee "$OUT/e2e.txt"
}
# The GPU suite's fuzz files (about 95-110 s each on an H200): gpu_fuzz runs them, gpu_fast the rest.
FUZZ_FILES="--ignore=tests/test_fused_fuzz.py --ignore=tests/test_fuzz.py --ignore=tests/test_mla_fuzz.py --ignore=tests/test_threads.py"
for step in $STEPS; do
    echo "=== $step"
    case $step in
        gpu_fast)
            timeout "${GPU_FAST_S:-440}" python3 -m pytest -m gpu -v -p no:cacheprovider -n 15 --durations=20 \
                --ignore=tests/typecheck $FUZZ_FILES tests > "$OUT/gpu_fast.txt" 2>&1
            echo "gpu_fast rc $?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_fast.txt" | tail -40 ;;
        gpu_fuzz)
            timeout "${GPU_FUZZ_S:-300}" python3 -m pytest -m gpu -v -p no:cacheprovider -n 15 --durations=15 \
                ${FUZZ_FILES//--ignore=/} --deselect "tests/test_mla_fuzz.py::test_fuzz_on_cuda[production]" \
                --deselect "tests/test_threads.py::test_threads_cuda[debug]" > "$OUT/gpu_fuzz.txt" 2>&1
            echo "gpu_fuzz rc $?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_fuzz.txt" | tail -40 ;;
        gpu_long)
            timeout "${GPU_LONG_S:-540}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 2 \
                "tests/test_mla_fuzz.py::test_fuzz_on_cuda[production]" "tests/test_threads.py::test_threads_cuda[debug]" \
                2>&1 | tail -30 | tee "$OUT/gpu_long.txt" ;;
        gpu_k)
            gpu_k_tests | tee "$OUT/gpu_k.txt" ;;
        gpu_k_trees)
            for tree in ${GPU_K_TREES:-}; do
                (cd "$tree" && export PYTHONPATH="$ROOT/$tree:/tmp/site" && gpu_k_tests) | tee "$OUT/gpu_k_$(basename "$tree").txt"
            done ;;
        tp)
            python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_tp.py 2>&1 | tail -40 | tee "$OUT/tp.txt" ;;
        memcheck)
            PYTHONPATH="$ROOT:/tmp/site" compute-sanitizer --tool memcheck --error-exitcode 1 \
                python3 tests/fuzz_sample.py --device cuda --examples 30 \
                2>&1 | tail -30 | tee "$OUT/memcheck.txt"; echo "memcheck rc ${PIPESTATUS[0]}" | tee -a "$OUT/memcheck.txt" ;;
        ws_sanitizer)
            PYTHONPATH="$ROOT:/tmp/site" timeout "${WS_SANITIZER_S:-300}" python3 tests/fused_ws_sample.py 2>&1 \
                | tail -20 | tee "$OUT/ws_sample.txt"
            for sanitizer in ${WS_SANITIZER_TOOLS:-memcheck synccheck}; do
                only=()
                [ "$sanitizer" = memcheck ] || only=(--kernel-name kns=project_kv_ws_kernel)
                (PYTHONPATH="$ROOT:/tmp/site" timeout "${WS_SANITIZER_S:-300}" compute-sanitizer --tool "$sanitizer" "${only[@]}" \
                    --error-exitcode 1 python3 tests/fused_ws_sample.py > "$OUT/ws_$sanitizer.txt" 2>&1
                 echo "ws $sanitizer rc $?" >> "$OUT/ws_$sanitizer.txt") &
            done
            wait
            tail -n 6 "$OUT"/ws_*.txt ;;
        ws_tests)
            timeout "${WS_TESTS_S:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_gpu_fused_ws.py 2>&1 \
                | tail -30 | tee "$OUT/ws_tests.txt"
            e2e ;;
        sglang)
            python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_sglang.py 2>&1 | tail -20 | tee "$OUT/sglang.txt"
            e2e ;;
        mla)
            python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_mla_gpu.py tests/test_mla_fuzz.py 2>&1 \
                | tail -40 | tee "$OUT/mla_gpu.txt"
            python3 -m typedkv bench --only MLA --out "$OUT/bench-mla" 2>&1 | tail -60 | tee "$OUT/mla_bench.txt"
            tool mla_sweep mla_sweep.py "${MLA_SWEEP_S:-240}" ;;
        bench)
            python3 -m typedkv bench --out "$OUT/bench" 2>&1 | tail -60 | tee "$OUT/bench.txt" ;;
        benchq)
            python3 -m typedkv bench --only "${BENCH_ONLY:-}" ${BENCH_TOKENS:+--tokens $BENCH_TOKENS} --no-compare \
                --out "$OUT/benchq" 2>&1 | tail -80 \
                | tee "$OUT/benchq.txt" ;;
        e2e)
            e2e ;;
        e2e_ab)
            # The tables only: each run's bench.json goes to /tmp, so $OUT stays small.
            for round in $(seq "${E2E_AB_ROUNDS:-2}"); do
                for tree in .old/base .; do
                    echo "--- $tree, round $round"
                    # From the tree itself: `python -m` puts the working directory first on the path.
                    (cd "$tree" && PYTHONPATH="$ROOT/$tree:/tmp/site" timeout "${FUSED_E2E_S:-200}" python3 -m typedkv bench \
                        --only e2e --out "/tmp/e2e_ab_$round" 2>&1 | tail -60)
                done
            done | tee "$OUT/e2e_ab.txt" ;;
        ab)
            for round in 1 2 3; do
                PYTHONPATH="$ROOT/.old/base:/tmp/site" python3 benchmarks/ab_time.py old ${AB_ARGS:-}
                PYTHONPATH="$ROOT:/tmp/site" python3 benchmarks/ab_time.py new ${AB_ARGS:-}
            done 2>/dev/null | tee "$OUT/ab.txt" ;;
        fused_sweep)
            tool fused_sweep fused_sweep.py "${FUSED_SWEEP_S:-200}" ${FUSED_SWEEP_T:-} ;;
        fused_ab)
            for round in $(seq "${FUSED_AB_ROUNDS:-3}"); do
                for side in old new; do
                    [ $side = old ] && path="$ROOT/.old/base" || path="$ROOT"
                    for where in ${FUSED_AB_WHERE:-dense pools}; do
                        [ $where = pools ] && flag=--pools || flag=
                        PYTHONPATH="$path:/tmp/site" python3 benchmarks/fused_sweep.py --defaults $flag ${FUSED_AB_T:-16 32 48 64} \
                            2>&1 | sed "s/^/$side /"
                    done
                done
            done | tee "$OUT/fused_ab.txt" ;;
        ws_sweep)
            IFS='|' read -ra sweep_sets <<< "${WS_SWEEP_ARGS:-}"
            for i in "${!sweep_sets[@]}"; do
                # shellcheck disable=SC2086
                tool "ws_sweep_$i" ws_sweep.py "${WS_SWEEP_S:-400}" ${sweep_sets[$i]}
            done
            [ ${#sweep_sets[@]} -gt 0 ] || tool ws_sweep ws_sweep.py "${WS_SWEEP_S:-400}" ;;
        mla_sweep)
            tool mla_sweep mla_sweep.py "${MLA_SWEEP_S:-240}" ;;
        peer)
            PYTHONPATH="$ROOT:/tmp/site" python3 benchmarks/peer_cases.py ${PEER_ARGS:-2} 2>&1 | tee "$OUT/peer.txt" ;;
        peer_design)
            tool peer_design peer_design.py "${PEER_DESIGN_S:-240}" --check ${PEER_DESIGN_ARGS:-5} ;;
        *)
            echo "unknown step: $step" >&2; exit 2 ;;
    esac
done
