#!/usr/bin/env bash
# One device call (benchmarks/NOTES.md): carry .whl (beartype) and, for the *_before/host steps,
# .old/base (git archive of the commit to compare with); install the wheels, then run the
# steps named in $STEPS, each logged under $OUT. Steps:
#   graphs_before  tests/test_gpu_graphs.py against .old/base/typedkv (the code before the fix)
#   graphs         tests/test_gpu_graphs.py on this checkout
#   gpu            the whole GPU suite on this checkout
#   gpu_fast       the GPU suite less its fuzz files and its two longest tests (15 workers, at most $GPU_FAST_S s;
#                  each test's result as it ends in $OUT/gpu_fast.txt, so a run stopped by its limit says what ran)
#   gpu_fuzz       the fuzz files gpu_fast leaves out (fused, K/V and MLA fuzz, threads in production mode;
#                  15 workers, at most $GPU_FUZZ_S s): with gpu_fast, the whole suite less gpu_long
#   gpu_long       those two tests (MLA fuzz in production mode, threads in debug mode; 2 workers)
#   mla_fuzz       the MLA fuzz on CUDA in production mode as $FUZZ_SHARDS (6) processes at once, each
#                  with its own hypothesis seed and 200 / shards examples (it compiles a kernel for most)
#   host           benchmarks/host_time.py, .old/base and this checkout alternated, $HOST_ROUNDS rounds (6)
#   mla_sweep      benchmarks/mla_sweep.py alone (at most $MLA_SWEEP_S s)
#   fused_sweep    benchmarks/fused_sweep.py alone (T list in $FUSED_SWEEP_T, with --pools for per-layer
#                  pools through KVMaterializer.into_pool; at most $FUSED_SWEEP_S s)
#   fuzz           the GPU fuzz and thread suites (8 workers, at most 300 s)
#   memcheck       tests/fuzz_sample.py (30 examples per op and mode) under compute-sanitizer memcheck
#   bench          typedkv bench (full)
#   ws_sanitizer   tests/fused_ws_sample.py plainly (compiling its kernels), then under each of
#                  $WS_SANITIZER_TOOLS (memcheck synccheck; racecheck may be named) at once, all but memcheck
#                  on the warp-specialised kernel alone, each at most $WS_SANITIZER_S s (300); reports in
#                  $OUT/ws_<tool>.txt
#   gpu_new        the GPU tests of paged pools, RoPE-only drafts, graph replay and memcheck (4 workers)
#   benchq         typedkv bench --only "$BENCH_ONLY" --no-compare (a subset, no baselines)
#   tp             the two-GPU tensor-parallel test (needs the nvidia-h200-x2 kind)
#   ab             benchmarks/ab_time.py: .old/base and this checkout alternated, 3 rounds ($AB_ARGS: its flags)
#   fused_ab       benchmarks/fused_sweep.py --defaults (dense, then --pools), .old/base and this checkout alternated,
#                  $FUSED_AB_ROUNDS rounds (3) at $FUSED_AB_T (16 32 48 64); $FUSED_AB_WHERE: dense, pools or both (default)
#   pools_sorted   benchmarks/fused_sweep.py --defaults --pools, the tokens' random slots as drawn and sorted
#                  (or as $POOLS_ORDERS names: random, sorted, contiguous), alternated, $POOLS_SORTED_ROUNDS
#                  rounds (2) at $POOLS_SORTED_T (64 16384 65536)
#   ab_vfirst      benchmarks/ab_time.py on this checkout, the K/V kernel's default (V's loads first)
#                  against KVConfig(v_first=False) alternated, 3 rounds (flat and paged pools too)
#   host_profile   benchmarks/host_profile.py: where the public calls' host time goes on this host
#   host_ratios    benchmarks/host_ratios.py (the bench's host-time ratios), the trees in $HOST_TREES
#                  (default: .old/base and this checkout) alternated, $HOST_ROUNDS rounds (3)
#   pdl_ab         programmatic dependent launch on and off, alternated in separate processes:
#                  benchmarks/peer_cases.py ($PDL_PEER_ROUNDS, 2), then typedkv bench --only e2e (the
#                  end-to-end section; $PDL_E2E_ROUNDS, 2)
#   order          benchmarks/order_probe.py: torch.mm and "auto" each timed twice, the rounds rotated and balanced,
#                  alternated ($ORDER_T, default 256 1024 2048; at most $ORDER_S s, 240)
#   peer           benchmarks/peer_cases.py: the standalone kernel at the peer-kernel cases ($PEER_ARGS, 2 rounds)
#   partner        benchmarks/partner_probe.py --check: K's RoPE partners gathered or loaded again (one-tile K)
#   peer_design    benchmarks/peer_design.py --check: the standalone kernel against a kernel of the peer's design,
#                  interleaved in one run ($PEER_DESIGN_ARGS: its flags and rounds, default 5; at most $PEER_DESIGN_S s)
#   split_ab       typedkv bench --only e2e with V written by the GEMM where measured faster (the default) and
#                  without (typedkv._launch.SPLIT_GEMM_FASTER emptied), alternated, $SPLIT_AB_ROUNDS (1)
#   gemm_split     benchmarks/gemm_split.py: the GEMM with V written straight to dense outputs ($GEMM_SPLIT_T)
#   e2e            typedkv bench --only e2e (the end-to-end section alone); with E2E_SMI=1 nvidia-smi samples the
#                  SM clock, power and clock-event reasons every 200 ms meanwhile ($OUT/e2e_smi.csv)
#   clocks         nvidia-smi -q (clocks, power, performance) into $OUT/clocks_smi.txt, then benchmarks/clock_probe.py:
#                  the SM clock and power while torch.mm and the materializer run ($CLOCKS_T, default 64 1024)
#   placement      benchmarks/placement_probe.py: the fused path against torch.mm with the weights at five places in memory
#                  ($PLACEMENT_T, default 64; at most $PLACEMENT_S s, 200)
#   l2promo        benchmarks/l2_promotion_probe.py: the fused path with its TMA descriptors' L2 promotion at
#                  none / 64 / 128 (Triton's) / 256 bytes ($L2PROMO_T; at most $L2PROMO_S s, 300)
#   tma            benchmarks/tma_probe.py: the GEMM alone, weight tiles through pointers or TMA ($TMA_T)
#   splitk         benchmarks/splitk_probe.py: the GEMM alone with finer columns or the hidden dimension split ($SPLITK_T)
#   persistent     benchmarks/persistent_probe.py: a GEMM + norm/RoPE epilogue, one program per tile or persistent ($PERSISTENT_T)
#   epilogue       benchmarks/epilogue_probe.py: the fused kernel's epilogue added to a plain GEMM a step at a time ($EPILOGUE_T)
#   ncu_fused      Nsight Compute on the fused projection at $NCU_T (64 2048; benchmarks/profile_fused.py) into
#                  each of $NCU_WHERE (dense, pools; default dense), benchmarks/ncu_regions.py on each
#                  per-instruction source page ($NCU_INTERVAL: ncu's --sampling-interval, auto)
#   ncu_pools      Nsight Compute (speed of light, memory, warp stalls, instructions) on the fused projection's
#                  kernel at $NCU_POOLS_T (64: the Triton kernel; 16384: the warp-specialised one), dense outputs,
#                  per-layer pools with consecutive slots, and torch.mm alone (benchmarks/profile_fused.py [--pools |
#                  --mm]); the three side by side from their raw pages (benchmarks/ncu_details.py --raw), the
#                  reports kept under /tmp/ncu (a call's $OUT returns at most 8 files). $NCU_POOLS_WHERE (default
#                  "dense pools mm") may add "bands": dense, the tiles in bands of $NCU_GROUP_N (8) weight tiles
#   mm_kernels     benchmarks/mm_kernels.py: cuBLAS's kernels for the bench's torch.mm, names and grids ($MM_KERNELS_T)
#   gap            benchmarks/e2e_gap.py: the end-to-end GEMM + kernel time taken apart ($GAP_T)
#   chunk          benchmarks/chunk_probe.py: GEMM + kernel in chunks of tokens L2 can hold ($CHUNK_T)
#   layer_overlap  benchmarks/layer_overlap_probe.py: the GEMM cut by groups of layers, each group's K/V kernel on a
#                  side stream beside the next group's GEMM ($LAYER_OVERLAP_T; at most $LAYER_OVERLAP_S s, 300)
#   after_gemm     benchmarks/after_gemm_sweep.py: the K/V kernel's configuration after the materializer's GEMM ($AFTER_GEMM_T)
#   gluon          benchmarks/gluon_probe.py: the warp-specialised Gluon GEMM, with K's epilogue or not ($GLUON_T)
#   ws_tests       the warp-specialised fused kernel's GPU tests (tests/test_gpu_fused_ws.py), then typedkv bench --only e2e
#   ws_sweep       benchmarks/ws_sweep.py: that kernel against GEMM + kernel at every T ($WS_SWEEP_ARGS:
#                  its T list, --tiles to compare tile shapes; several runs' arguments separated by "|")
#   streamk        benchmarks/streamk_probe.py: the GEMM alone, its k-steps spread evenly over every SM ($STREAMK_T)
#   streamk_ws     benchmarks/streamk_ws_probe.py: the warp-specialised GEMM cut the stream-K way against one tile a
#                  program and torch.mm ($STREAMK_WS_T, default 64 128 256 512 1024 2048; at most $STREAMK_WS_S s)
#   small_t        benchmarks/small_t_probe.py: the GEMM at small T with hidden's ring apart from the weight's
#                  ($SMALL_T_T, default 16 48 64; at most $SMALL_T_S s)
#   ws_small       benchmarks/ws_sweep.py --small: the warp-specialised kernel's other tiles against the Triton kernel
#                  and GEMM + kernel ($WS_SMALL_T, default 16 32 48 64; at most $WS_SMALL_S s)
#   fused_early    benchmarks/fused_sweep.py --early, dense then --pools ($FUSED_EARLY_T, default 48 64): the
#                  epilogue's loads and the RoPE rows before the loop or after it
#   sglang         the GPU tests against sglang's own helper, then typedkv bench's end-to-end section
#                  (carry .sglang: the pinned sglang wheel, a cp311 wheel that pip must not install here)
#   mla            the MLA GPU tests (numerics, pools, graphs, fuzz, memcheck), typedkv bench --only MLA, and
#                  benchmarks/mla_sweep.py (the MLA launch configuration)
#   gpu_k_trees    gpu_k's selection in each tree of $GPU_K_TREES (copies carried under .old/, e.g. a fix
#                  reverted: its tests must fail there), each against its own package
#   gpu_k          the GPU tests of $GPU_K_FILES (default tests) whose names match $GPU_K (pytest -k; 8 workers)
#   fused_k        the fused projection's GPU tests whose names match $FUSED_K (pytest -k; 4 workers)
#   fused          the fused projection's GPU tests (bf16 numerics, pools, FP8, graphs, compile, no sync; 8
#                  workers), benchmarks/fused_sweep.py (launch configurations vs torch.mm; T list in
#                  $FUSED_SWEEP_T, default its own), then the end-to-end bench (each projection path
#                  pinned, vs torch.mm alone): the data for the "auto" table
#                  (typedkv._launch.PROJECTION_FUSED_FASTER) and ProjectionConfig's defaults
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ROOT=$(pwd)
# One developer script of benchmarks/, at most LIMIT seconds, its output also in $OUT/NAME.txt:
#   probe NAME SCRIPT LIMIT [ARG ...]
probe() {
    local name=$1 script=$2 limit=$3
    shift 3
    timeout "$limit" env PYTHONPATH="$ROOT:/tmp/site" python3 "benchmarks/$script" "$@" 2>&1 | tee "$OUT/$name.txt"
}
# gpu_k's selection of GPU tests, run in the current directory (its tests against the package on PYTHONPATH).
gpu_k_tests() {
    timeout "${GPU_K_S:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 --ignore=tests/typecheck \
        ${GPU_K_FILES:-tests} -k "${GPU_K:-}" 2>&1 | tail -40
}
fused_sweep() {
    probe fused_sweep fused_sweep.py "${FUSED_SWEEP_S:-200}" ${FUSED_SWEEP_T:-}
}
# The GPU suite's fuzz files (about 95-110 s each on the H200): gpu_fuzz runs them, gpu_fast the rest.
FUZZ_FILES="--ignore=tests/test_fused_fuzz.py --ignore=tests/test_fuzz.py --ignore=tests/test_mla_fuzz.py --ignore=tests/test_threads.py"
for step in $STEPS; do
    echo "=== $step"
    case $step in
        graphs)
            python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_graphs.py 2>&1 | tail -40 | tee "$OUT/graphs.txt" ;;
        graphs_before)
            (cd .old/base && python3 -m pytest -c "$ROOT/pyproject.toml" --rootdir "$ROOT" -m gpu -q -p no:cacheprovider \
                "$ROOT/tests/test_gpu_graphs.py" 2>&1 | tail -40) | tee "$OUT/graphs_before.txt" ;;
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
        mla_fuzz)
            shards=${FUZZ_SHARDS:-6}
            for shard in $(seq "$shards"); do
                TYPEDKV_FUZZ_SEEDED=1 TYPEDKV_FUZZ_EXAMPLES=$(( (200 + shards - 1) / shards )) timeout "${MLA_FUZZ_S:-300}" \
                    python3 -m pytest -m gpu -q -p no:cacheprovider --hypothesis-seed="$shard" \
                    "tests/test_mla_fuzz.py::test_fuzz_on_cuda[production]" > "$OUT/mla_fuzz_$shard.txt" 2>&1 &
            done
            wait
            tail -n 3 "$OUT"/mla_fuzz_*.txt ;;
        gpu)
            python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 --ignore=tests/typecheck tests 2>&1 | tail -40 | tee "$OUT/gpu.txt" ;;
        host)
            for round in $(seq "${HOST_ROUNDS:-6}"); do
                PYTHONPATH="$ROOT/.old/base:/tmp/site" python3 benchmarks/host_time.py
                PYTHONPATH="$ROOT:/tmp/site" python3 benchmarks/host_time.py
            done 2>&1 | grep typedkv | tee "$OUT/host.txt" ;;
        fuzz)
            timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_fuzz.py tests/test_threads.py 2>&1 \
                | tail -30 | tee "$OUT/fuzz.txt" ;;
        memcheck)
            PYTHONPATH="$ROOT:/tmp/site" compute-sanitizer --tool memcheck --error-exitcode 1 \
                python3 tests/fuzz_sample.py --device cuda --examples 30 \
                2>&1 | tail -30 | tee "$OUT/memcheck.txt"; echo "memcheck rc ${PIPESTATUS[0]}" | tee -a "$OUT/memcheck.txt" ;;
        ws_sanitizer)
            PYTHONPATH="$ROOT:/tmp/site" timeout "${WS_SANITIZER_S:-300}" python3 tests/fused_ws_sample.py 2>&1 \
                | tail -20 | tee "$OUT/ws_sample.txt"
            for tool in ${WS_SANITIZER_TOOLS:-memcheck synccheck}; do
                only=()
                [ "$tool" = memcheck ] || only=(--kernel-name kns=project_kv_ws_kernel)
                (PYTHONPATH="$ROOT:/tmp/site" timeout "${WS_SANITIZER_S:-300}" compute-sanitizer --tool "$tool" "${only[@]}" \
                    --error-exitcode 1 python3 tests/fused_ws_sample.py > "$OUT/ws_$tool.txt" 2>&1
                 echo "ws $tool rc $?" >> "$OUT/ws_$tool.txt") &
            done
            wait
            tail -n 6 "$OUT"/ws_*.txt ;;
        gpu_new)
            python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_gpu.py \
                -k "rope_only or paged or graph_replay or sanitizer" 2>&1 | tail -40 | tee "$OUT/gpu_new.txt" ;;
        benchq)
            python3 -m typedkv bench --only "${BENCH_ONLY:-}" --no-compare --out "$OUT/benchq" 2>&1 | tail -80 \
                | tee "$OUT/benchq.txt" ;;
        tp)
            python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_tp.py 2>&1 | tail -40 | tee "$OUT/tp.txt" ;;
        ab)
            for round in 1 2 3; do
                PYTHONPATH="$ROOT/.old/base:/tmp/site" python3 benchmarks/ab_time.py old ${AB_ARGS:-}
                PYTHONPATH="$ROOT:/tmp/site" python3 benchmarks/ab_time.py new ${AB_ARGS:-}
            done 2>/dev/null | tee "$OUT/ab.txt" ;;
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
        pools_sorted)
            for round in $(seq "${POOLS_SORTED_ROUNDS:-2}"); do
                for order in ${POOLS_ORDERS:-random sorted}; do
                    [ $order = random ] && flag= || flag=--$order
                    PYTHONPATH="$ROOT:/tmp/site" python3 benchmarks/fused_sweep.py --defaults --pools $flag \
                        ${POOLS_SORTED_T:-64 16384 65536} 2>&1 | sed "s/^/$order /"
                done
            done | tee "$OUT/pools_sorted.txt" ;;
        ab_vfirst)
            for round in 1 2 3; do
                PYTHONPATH="$ROOT:/tmp/site" python3 benchmarks/ab_time.py default --paged
                PYTHONPATH="$ROOT:/tmp/site" python3 benchmarks/ab_time.py v_last --v-last
            done 2>/dev/null | tee "$OUT/ab_vfirst.txt" ;;
        sglang)
            python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_sglang.py 2>&1 | tail -20 | tee "$OUT/sglang.txt"
            python3 -m typedkv bench --only e2e --out "$OUT/e2e" 2>&1 | tail -40 | tee "$OUT/e2e.txt" ;;
        bench)
            python3 -m typedkv bench --out "$OUT/bench" 2>&1 | tail -60 | tee "$OUT/bench.txt" ;;
        mla)
            python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_mla_gpu.py tests/test_mla_fuzz.py 2>&1 \
                | tail -40 | tee "$OUT/mla_gpu.txt"
            python3 -m typedkv bench --only MLA --out "$OUT/bench-mla" 2>&1 | tail -60 | tee "$OUT/mla_bench.txt"
            PYTHONPATH="$ROOT:/tmp/site" python3 benchmarks/mla_sweep.py 2>&1 | tee "$OUT/mla_sweep.txt" ;;
        mla_sweep)
            probe mla_sweep mla_sweep.py "${MLA_SWEEP_S:-240}" ;;
        fused_sweep)
            fused_sweep ;;
        host_profile)
            PYTHONPATH="$ROOT:/tmp/site" python3 benchmarks/host_profile.py ${HOST_PROFILE_CALLS:-} 2>&1 | tee "$OUT/host_profile.txt" ;;
        pdl_ab)
            for round in $(seq "${PDL_PEER_ROUNDS:-2}"); do
                PYTHONPATH="$ROOT:/tmp/site" python3 benchmarks/peer_cases.py 1 2>&1 | sed 's/^/pdl   /'
                PYTHONPATH="$ROOT:/tmp/site" python3 benchmarks/peer_cases.py --no-pdl 1 2>&1 | sed 's/^/nopdl /'
            done | tee "$OUT/pdl_peer.txt"
            for round in $(seq "${PDL_E2E_ROUNDS:-2}"); do
                timeout 150 python3 -m typedkv bench --only e2e --out "$OUT/e2e_pdl_$round" 2>&1 | grep -A9 "^     T " \
                    | sed 's/^/pdl   /'
                timeout 150 python3 -c "import sys; from typedkv import _launch, _cli; _launch.PROGRAMMATIC_LAUNCH = False; \
sys.exit(_cli.main(['bench', '--only', 'e2e', '--out', '$OUT/e2e_nopdl_$round']))" 2>&1 | grep -A9 "^     T " \
                    | sed 's/^/nopdl /'
            done | tee "$OUT/pdl_e2e.txt" ;;
        tma)
            probe tma tma_probe.py "${TMA_S:-400}" ${TMA_T:-} ;;
        splitk)
            probe splitk splitk_probe.py "${SPLITK_S:-240}" ${SPLITK_T:-} ;;
        persistent)
            probe persistent persistent_probe.py "${PERSISTENT_S:-240}" ${PERSISTENT_T:-} ;;
        epilogue)
            probe epilogue epilogue_probe.py "${EPILOGUE_S:-300}" ${EPILOGUE_T:-} ;;
        ncu_fused)
            mkdir -p /tmp/ncu
            for t in ${NCU_T:-64 2048}; do
                for where in ${NCU_WHERE:-dense}; do
                    [ $where = pools ] && flag=--pools || flag=
                    timeout 200 ncu --clock-control none -k regex:project_kv --launch-skip 3 --launch-count 1 --set full \
                        --warp-sampling-interval "${NCU_INTERVAL:-auto}" --import-source yes -f -o "/tmp/ncu/fused_${where}_T$t" \
                        env PYTHONPATH="$ROOT:/tmp/site" python3 benchmarks/profile_fused.py "$t" $flag > "/tmp/ncu/ncu_${where}_T$t.log" 2>&1
                    ncu -i "/tmp/ncu/fused_${where}_T$t.ncu-rep" --page source --csv --print-source sass > "/tmp/ncu/source_${where}_T$t.csv" 2>&1
                    echo "T=$t $where"; python3 benchmarks/ncu_regions.py "/tmp/ncu/source_${where}_T$t.csv"
                done
            done 2>&1 | tee "$OUT/ncu_fused.txt" ;;
        ncu_pools)
            mkdir -p /tmp/ncu
            for t in ${NCU_POOLS_T:-64 16384}; do
                pages=
                for where in ${NCU_POOLS_WHERE:-dense pools mm}; do
                    flag=; kernels=regex:project_kv
                    [ $where = pools ] && flag=--pools
                    [ $where = bands ] && flag="--group-n ${NCU_GROUP_N:-8}"
                    [ $where = mm ] && flag=--mm && kernels=regex:nvjet\|gemm\|xmma\|cutlass
                    timeout 200 ncu --clock-control none -k "$kernels" --launch-skip 3 --launch-count 1 \
                        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
                        --section SchedulerStats --section LaunchStats --section Occupancy --section InstructionStats \
                        --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,smsp__inst_executed_op_global_st.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum \
                        -f -o "/tmp/ncu/${where}_T$t" env PYTHONPATH="$ROOT:/tmp/site" \
                        python3 benchmarks/profile_fused.py "$t" $flag > "/tmp/ncu/${where}_T$t.log" 2>&1 \
                        || tail -5 "/tmp/ncu/${where}_T$t.log"
                    ncu -i "/tmp/ncu/${where}_T$t.ncu-rep" --page raw --csv > "/tmp/ncu/raw_${where}_T$t.csv" 2>&1
                    pages="$pages $where=/tmp/ncu/raw_${where}_T$t.csv"
                done
                echo "=== T=$t"
                python3 benchmarks/ncu_details.py --raw $pages
            done 2>&1 | tee "$OUT/ncu_pools.txt" ;;
        mm_kernels)
            probe mm_kernels mm_kernels.py "${MM_KERNELS_S:-120}" ${MM_KERNELS_T:-} ;;
        gap)
            probe gap e2e_gap.py "${GAP_S:-240}" ${GAP_T:-} ;;
        chunk)
            probe chunk chunk_probe.py "${CHUNK_S:-300}" ${CHUNK_T:-} ;;
        layer_overlap)
            probe layer_overlap layer_overlap_probe.py "${LAYER_OVERLAP_S:-300}" ${LAYER_OVERLAP_T:-} ;;
        after_gemm)
            probe after_gemm after_gemm_sweep.py "${AFTER_GEMM_S:-300}" ${AFTER_GEMM_T:-} ;;
        gluon)
            probe gluon gluon_probe.py "${GLUON_S:-300}" ${GLUON_T:-} ;;
        ws_sweep)
            # Several invocations: argument sets separated by "|", each with WS_SWEEP_S seconds at most.
            IFS='|' read -ra sweep_sets <<< "${WS_SWEEP_ARGS:-}"
            for i in "${!sweep_sets[@]}"; do
                # shellcheck disable=SC2086
                probe "ws_sweep_$i" ws_sweep.py "${WS_SWEEP_S:-400}" ${sweep_sets[$i]}
            done
            [ ${#sweep_sets[@]} -gt 0 ] || probe ws_sweep ws_sweep.py "${WS_SWEEP_S:-400}" ;;
        ws_tests)
            timeout "${WS_TESTS_S:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_gpu_fused_ws.py 2>&1 \
                | tail -30 | tee "$OUT/ws_tests.txt"
            timeout "${FUSED_E2E_S:-200}" python3 -m typedkv bench --only e2e --out "$OUT/e2e" 2>&1 | tail -60 \
                | tee "$OUT/e2e.txt" ;;
        streamk)
            probe streamk streamk_probe.py "${STREAMK_S:-300}" ${STREAMK_T:-} ;;
        ws_small)
            probe ws_small ws_sweep.py "${WS_SMALL_S:-240}" --small ${WS_SMALL_T:-} ;;
        fused_early)
            probe fused_early fused_sweep.py "${FUSED_EARLY_S:-200}" --early ${FUSED_EARLY_T:-48 64}
            probe fused_early_pools fused_sweep.py "${FUSED_EARLY_S:-200}" --early --pools ${FUSED_EARLY_T:-48 64} ;;
        streamk_ws)
            probe streamk_ws streamk_ws_probe.py "${STREAMK_WS_S:-300}" ${STREAMK_WS_T:-} ;;
        small_t)
            probe small_t small_t_probe.py "${SMALL_T_S:-240}" ${SMALL_T_T:-} ;;
        host_ratios)
            for round in $(seq "${HOST_ROUNDS:-3}"); do
                for tree in ${HOST_TREES:-.old/base .}; do
                    PYTHONPATH="$ROOT/$tree:/tmp/site" python3 benchmarks/host_ratios.py "$tree"
                done
            done 2>&1 | tee "$OUT/host_ratios.txt" ;;
        split_ab)
            for round in $(seq "${SPLIT_AB_ROUNDS:-1}"); do
                timeout 200 python3 -m typedkv bench --only e2e --out "$OUT/e2e_split_$round" 2>&1 | grep -A9 "^     T " \
                    | sed 's/^/split   /'
                timeout 200 python3 -c "import sys; from typedkv import _launch, _cli; _launch.SPLIT_GEMM_FASTER.clear(); \
sys.exit(_cli.main(['bench', '--only', 'e2e', '--out', '$OUT/e2e_nosplit_$round']))" 2>&1 | grep -A9 "^     T " \
                    | sed 's/^/nosplit /'
            done | tee "$OUT/split_e2e.txt" ;;
        gemm_split)
            timeout "${GEMM_SPLIT_S:-150}" env PYTHONPATH="$ROOT:/tmp/site" python3 benchmarks/gemm_split.py ${GEMM_SPLIT_T:-} 2>&1 \
                | tee "$OUT/gemm_split.txt" ;;
        order)
            probe order order_probe.py "${ORDER_S:-240}" ${ORDER_T:-} ;;
        peer)
            PYTHONPATH="$ROOT:/tmp/site" python3 benchmarks/peer_cases.py ${PEER_ARGS:-2} 2>&1 | tee "$OUT/peer.txt" ;;
        partner)
            probe partner partner_probe.py "${PARTNER_S:-240}" --check ${PARTNER_ARGS:-5} ;;
        peer_design)
            probe peer_design peer_design.py "${PEER_DESIGN_S:-240}" --check ${PEER_DESIGN_ARGS:-5} ;;
        placement)
            probe placement placement_probe.py "${PLACEMENT_S:-200}" ${PLACEMENT_T:-} ;;
        l2promo)
            probe l2promo l2_promotion_probe.py "${L2PROMO_S:-300}" ${L2PROMO_T:-} ;;
        clocks)
            nvidia-smi -q -d CLOCK,POWER,PERFORMANCE,TEMPERATURE > "$OUT/clocks_smi.txt" 2>&1
            probe clocks clock_probe.py "${CLOCKS_S:-240}" ${CLOCKS_T:-} ;;
        e2e)
            smi=
            if [ "${E2E_SMI:-0}" = 1 ]; then
                nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
                    --format=csv -lms 200 > "$OUT/e2e_smi.csv" 2>&1 &
                smi=$!
            fi
            timeout "${FUSED_E2E_S:-200}" python3 -m typedkv bench --only e2e --out "$OUT/e2e" 2>&1 | tail -60 \
                | tee "$OUT/e2e.txt"
            [ -z "$smi" ] || kill "$smi" ;;
        gpu_k_trees)
            # The same selection as gpu_k in each tree of $GPU_K_TREES (each a copy of the repository, e.g.
            # this checkout with a fix reverted, carried under .old/), its own tests against its own package.
            for tree in ${GPU_K_TREES:-}; do
                (cd "$tree" && export PYTHONPATH="$ROOT/$tree:/tmp/site" && gpu_k_tests) | tee "$OUT/gpu_k_$(basename "$tree").txt"
            done ;;
        gpu_k)
            gpu_k_tests | tee "$OUT/gpu_k.txt" ;;
        fused_k)
            timeout "${FUSED_TEST_S:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_gpu_fused.py \
                -k "${FUSED_K:-}" 2>&1 | tail -40 | tee "$OUT/fused_k.txt" ;;
        fused)
            timeout "${FUSED_TEST_S:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_gpu_fused.py 2>&1 \
                | tail -60 | tee "$OUT/fused_gpu.txt"
            fused_sweep
            timeout "${FUSED_E2E_S:-150}" python3 -m typedkv bench --only e2e --out "$OUT/e2e" 2>&1 | tail -60 \
                | tee "$OUT/fused_e2e.txt" ;;
        *)
            echo "unknown step: $step" >&2; exit 2 ;;
    esac
done
