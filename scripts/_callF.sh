set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
python3 -m pytest -q -s -p no:cacheprovider -rf -m gpu tests/gpu tests/parity/test_fp8_weights.py tests/parity/test_llava_parity.py tests/unit 2>&1 | grep -E "FAILED|passed|failed|mean \|logit" | tail -20
python3 -m tests.kernels.bench_gemv 2>&1 | tail -12
python3 -m tests.kernels.bench_fp8_gemm 1 2>&1 | tail -6
