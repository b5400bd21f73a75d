#!/usr/bin/env bash
# compute-sanitizer over the kernel tests at their small sizes (the sanitizer runs them 10-100x
# slower). Run on a GPU machine from the repository root: bash tests/gpu_sanitize.sh
# racecheck skips cuBLAS's nvjet GEMM kernels: it reports shared-memory hazards inside their split-K
# variants, which we can neither see nor change; memcheck still covers them.
set -euo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
small="tiny or odd or small or ties or greedy or embed or (1-2-64) or (7-2-64) or rmsnorm or graph or act_quant or (normed_input and not 600) or exact_cases or gathers_rows"
kernels=(tests/test_k_attention.py tests/test_k_hc.py tests/test_k_compress.py tests/test_k_moe.py
         tests/test_k_sample.py tests/test_k_gemm.py tests/test_gpu_runtime.py tests/test_k_fp8.py
         tests/test_k_moe_prefill.py tests/test_k_kv_fp8.py tests/test_k_moe_fp4.py)
for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool"
    skip=()
    [ "$tool" = racecheck ] && skip=(--kernel-name-exclude kns=nvjet)
    compute-sanitizer --tool "$tool" "${skip[@]}" --error-exitcode 99 --print-limit 20 \
        python3 -m pytest -q -x -p no:cacheprovider -m gpu "${kernels[@]}" -k "$small"
done
