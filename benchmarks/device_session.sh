#!/usr/bin/env bash
# One call of the lent GPU, by stage: what the open issues still need measured there, each stage
# sized for one call (at most 10 minutes) and at most 8 files back under $OUT.
#
#   bash benchmarks/device_session.sh STAGE [BUDGET_S]
#
# Stages (the issue each serves):
#   compile  issue 50: compiled numbers, the compiled fuzzer's CI slice, the GPU compile tests
#   suite1   issue 51: the first half of the GPU suite (pytest -m gpu), by file
#   suite2   issue 51: the second half
#   suite    issue 51: the whole GPU suite at once, tests spread over pytest-xdist workers
#            (compiling dominates, and the machine has 16 cores for one GPU)
#   host     issue 52: flexattn bench --mode host, then benchmarks.host_profile
#   cp       issue 54: the merge in the kernel and memory per rank, ranks as streams on one GPU
#   numbers  issue 50: numbers as kernel arguments against literals (d=128, four rounds)
#   hopper   issues 52/53: the Hopper (Gluon) forward and backward GPU tests, CUDA graphs and streams
#            (the kept choices and prepared Gluon launches run there), over pytest-xdist workers
#   softcap  issue 50: only the soft-cap forward + backward, the one row two rounds left open, in
#            eight alternating rounds of about a second each (do_bench with --rep 20 ran it once)
#   train    issue 53: the training benchmark's GQA rows and the d=128 causal MHA row beside torch's
#            FLASH path and cuDNN, with the 'below target:' lines (FLASH: see the stage)
# Run from the repository root; BUDGET_S (default 560) bounds the whole stage.
set -o pipefail
STAGE=${1:?a stage: compile, suite, suite1, suite2, host, cp, numbers, softcap or train}
BUDGET=${2:-560}
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flexattn-device-out}
mkdir -p "$OUT"
T0=$SECONDS
left() { local s=$(( BUDGET - (SECONDS - T0) - ${1:-10} )); echo $(( s > 1 ? s : 1 )); }  # timeout takes no s <= 0
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  git rev-parse HEAD 2>/dev/null; } 2>&1 | tee "$OUT/env.txt"

gpu_files() {  # the test files with GPU tests, sorted; half 1 or 2 of them
    local files
    files=$(grep -l "pytest.mark.gpu" tests/test_*.py | sort)
    local n; n=$(echo "$files" | wc -l)
    if [ "$1" = 1 ]; then echo "$files" | head -n $(( (n + 1) / 2 )); else echo "$files" | tail -n +$(( (n + 1) / 2 + 1 )); fi
}

case "$STAGE" in
compile)
    timeout "$(left)" python3 -m pytest -q -p no:cacheprovider -rf tests/test_compile_numbers.py \
        tests/test_fuzz_compiled.py tests/test_gpu_compile.py 2>&1 | tee "$OUT/compile.log" | tail -25 ;;
suite1|suite2)
    # shellcheck disable=SC2046
    timeout "$(left)" python3 -m pytest -p no:cacheprovider -m gpu -rfE -v --durations=10 \
        $(gpu_files "${STAGE#suite}") > "$OUT/$STAGE.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/$STAGE.log" | awk '{print $NF}' | sort | uniq -c
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$STAGE.log" | tail -30 ;;
suite)
    # shellcheck disable=SC2046
    timeout "$(left)" python3 -m pytest -p no:cacheprovider -m gpu -rfE -v --durations=15 \
        -n "${WORKERS:-8}" --dist worksteal $(gpu_files 1) $(gpu_files 2) > "$OUT/suite.log" 2>&1
    grep -oE " (PASSED|FAILED|ERROR|SKIPPED) " "$OUT/suite.log" | sort | uniq -c
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/suite.log" | tail -30 ;;
host)
    unset FLEXATTN_POISON_OUTPUTS
    timeout "$(left 200)" python3 -m flexattn.bench.host --out "$OUT/host.json" 2>&1 | tee "$OUT/host.log" | tail -30
    timeout "$(left)" python3 -m benchmarks.host_profile --out-dir "$OUT" 2>&1 | tail -10 ;;
cp)
    timeout "$(left 240)" python3 -m benchmarks.context_parallel --masks document,sliding_window --ranks 2 --check \
        --out "$OUT/cp_merge.json" 2>&1 | tee "$OUT/cp_merge.log" | tail -30
    timeout "$(left)" python3 -m benchmarks.cp_memory --out "$OUT/cp_memory.json" 2>&1 | tee "$OUT/cp_memory.log" | tail -20 ;;
numbers)
    timeout "$(left)" python3 -m benchmarks.number_inputs --head-dims 128 --rounds 4 --out "$OUT/numbers.json" 2>&1 \
        | tee "$OUT/numbers.log" | tail -25 ;;
hopper)
    timeout "$(left)" python3 -m pytest -p no:cacheprovider -m gpu -rfE -q -n "${WORKERS:-8}" --dist worksteal \
        tests/test_gpu_hopper_forward.py tests/test_gpu_hopper_backward.py tests/test_gpu_cuda_graph.py \
        tests/test_gpu_streams.py > "$OUT/hopper.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/hopper.log" | tail -30 ;;
softcap)
    timeout "$(left)" python3 -m benchmarks.number_inputs --head-dims 128 --rounds 8 --rep 1000 --skip-compiles --cases softcap \
        --passes fwd+bwd --out "$OUT/softcap.json" 2>&1 | tee "$OUT/softcap.log" | tail -10 ;;
train)
    # torch's FLASH path needs FlashAttention-4 in /tmp/site, which travels in two calls
    # (../shared/tools/flash4_wheels.sh): one carrying .flash4a (mkdir -p /tmp/flash4a && cp .flash4a/*
    # /tmp/flash4a/), then this one carrying .flash4b, unpacked here. Without it the FLASH targets say
    # 'not measured'. About 60 s for the MHA row, 30 s for each of the 8 GQA rows (compiles included).
    unset FLEXATTN_POISON_OUTPUTS
    if [ ! -d /tmp/site ] && [ -f .flash4b/flash4_setup.sh ]; then bash .flash4b/flash4_setup.sh 2>&1 | tail -2; fi
    if [ -d /tmp/site ]; then export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
    else echo "no FlashAttention-4 in /tmp/site: torch's FLASH path will not run"; fi
    train="python3 -m benchmarks.targets --issue 53 --run bwd --head-dims 128 --torch-flash --two-pass --rep 30"
    # The reference first, bounded, so the GQA rows keep the rest: 16k tokens, B2 H16.
    timeout "$(left 400)" $train --variants causal --out "$OUT/train_mha.json" 2>&1 | tee "$OUT/train_mha.log" \
        | grep -v '^{'
    timeout "$(left)" $train --variants causal document_mask --heads 32:8 8:1 --seq-len 8192 32768 \
        --out "$OUT/train_gqa.json" 2>&1 | tee "$OUT/train_gqa.log" | grep -v '^{' ;;
*)
    echo "unknown stage $STAGE" >&2; exit 2 ;;
esac
echo "[$STAGE: $(( SECONDS - T0 )) s]"
