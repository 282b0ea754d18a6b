python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
timeout 240 python -m pytest -q -x tests/gpu/test_gpu_paged_decode.py 2>&1 | tail -25
timeout 200 python -m benchmarks.paged_decode 2>&1 | tail -8
timeout 300 python -m pytest -q tests/gpu --ignore=tests/gpu/test_gpu_quantization.py --ignore=tests/gpu/test_gpu_paged_decode.py 2>&1 | tail -6
