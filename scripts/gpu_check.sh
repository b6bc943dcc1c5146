#!/usr/bin/env bash
# One call on a GPU machine: the gpu-marked tests, the decode-step profile and the three benches on the
# llava-1.5-7b-shaped random checkpoint, with results under ${OUT:-./gpu-out}.
#   bash scripts/gpu_check.sh [tests] [profile] [latency] [throughput] [throughput-same] [weight-only] [serve]
#                             [serve-profile] [tp] [kernels] [quant] [multinode] [ba-throughput] [ba-ttft] [ba-serve] [ba-qwen]
#   (default: all but throughput-same, weight-only, serve-profile, tp and kernels; weight-only: decode latency of fp16, int8 and
#   int4 weights; serve-profile samples the server with py-spy, if installed, during a concurrency-32 run without
#   baseline; tp: tensor parallelism on two GPUs, one GPU / two eager / two with graphs, and its GPU test;
#   kernels: the int4 / W8A8 / FP8 / vision-tower kernels' gpu tests, per-shape timings and the GEMM / attention
#   overlap probe; quant: decode latency of
#   fp16 and the five quantized configurations in one call; multinode: two-node tensor parallelism over NCCL on two GPUs;
#   ba-*: issue 35's table, this code then the code in $BEFORE (a `git archive REV mmserve` extracted there), each
#   step one pair: 512-request throughput fp16 and FP8 + FP8 KV (~6 min), batch-1 TTFT offline (~1.5 min), Triton
#   HTTP streaming at concurrency 1 with the server's phases (~4 min), Qwen2.5-VL-7B with one 1440² picture (~5 min),
#   the int4 kernels per projection and int4_g128 decode latency (up to 7 min a tree, so a pair may need two calls:
#   leave BEFORE empty and check out each tree in turn on the same warm machine; $BEFORE may hold any other code))
# Wheels for packages the machine lacks (fastapi, grpcio, av, ...) may sit in .whl/ (see docs/benchmarks.md).
set -uo pipefail
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
steps=${*:-tests profile latency throughput serve}
bench="python3 -m mmserve.entrypoints.cli bench"
# the random checkpoint of preset $1 (of family $2, default llava), written on first use: its directory
preset_dir() {
  python3 -c "from mmserve.bench.workload import ModelSource as S; print(S(preset='$1', family='${2:-llava}').resolve())" | tail -1
}
# `mmserve serve` of the llava-1.5-7b preset on :8000 / :8001 with the code on $2 (a PYTHONPATH; default: this
# one), its log in $1; sets S to its pid and returns once it is ready (at most 4 minutes)
start_llava_server() {
  local model
  model=$(preset_dir llava-1.5-7b)
  env PYTHONPATH="${2:-$PYTHONPATH}" python3 -m mmserve.entrypoints.cli serve "$model" --device cuda --dtype float16 \
    --http-port 8000 --grpc-port 8001 --kv-cache-memory-fraction 0.4 --log-level warning > "$1" 2>&1 & S=$!
  for _ in $(seq 240); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=2)" 2>/dev/null && break; sleep 1; done
}
for step in $steps; do
  case $step in
    tests) python3 -m pytest -q -p no:cacheprovider -rf -m gpu tests/gpu tests/parity tests/unit 2>&1 | tee "$OUT/gpu_tests.log" | tail -5 ;;
    profile) for b in 1 32; do
               python3 -m mmserve.bench.step_profile --preset llava-1.5-7b --batch-size $b --prefill-batch $((b == 32 ? 32 : 0)) \
                 --mixed-batch $((b == 32 ? 128 : 0)) > "$OUT/profile_b$b.txt" 2>&1
               grep -E "^(batch|TTFT|prefix|prefill|mixed)" "$OUT/profile_b$b.txt"; done ;;
    latency) $bench latency --preset llava-1.5-7b --batch-sizes 1,8,32,64 --input-len 24 --output-len 64 \
               --out "$OUT/latency.json" --markdown "$OUT/latency.md" --plot-dir "$OUT/plots" 2> "$OUT/latency.err"
             cat "$OUT/latency.md" ;;
    throughput) $bench throughput --preset llava-1.5-7b --num-requests 512 --input-len 128 --output-len 128 \
               --hf-batch-size 32 --max-num-seqs 128 --out "$OUT/throughput.json" --markdown "$OUT/throughput.md" \
               2> "$OUT/throughput.err"
             cat "$OUT/throughput.md" ;;
    weight-only) for q in none int8 int4; do   # decode speed of weight-only quantization against fp16, same call
               flag=$([ $q = none ] || echo "--quantization $q")
               $bench latency --preset llava-1.5-7b --batch-sizes 1,8,32 --input-len 24 --output-len 64 --baseline none \
                 $flag --out "$OUT/latency_$q.json" --markdown "$OUT/latency_$q.md" 2> "$OUT/latency_$q.err"
               echo "== $q"; cat "$OUT/latency_$q.md"; done ;;
    throughput-same) $bench throughput --preset llava-1.5-7b --num-requests 512 --input-len 128 --output-len 128 \
               --hf-batch-size 32 --max-num-seqs 128 --same-image --out "$OUT/throughput_same.json" \
               --markdown "$OUT/throughput_same.md" 2> "$OUT/throughput_same.err"
             cat "$OUT/throughput_same.md" ;;
    serve) start_llava_server "$OUT/server.log"
           $bench serve --url http://127.0.0.1:8000 --protocol triton-http --preset llava-1.5-7b --baseline hf \
             --request-rates 4,inf --concurrency 1,8,32 --num-requests 32 --input-len 24 --output-len 128 \
             --max-duration 60 --request-timeout 120 --out "$OUT/serve.json" --markdown "$OUT/serve.md" \
             --plot-dir "$OUT/plots" 2> "$OUT/serve.err"
           kill $S; cat "$OUT/serve.md" ;;
    serve-profile) start_llava_server "$OUT/server_profiled.log"
           $bench serve --url http://127.0.0.1:8000 --protocol triton-http --preset llava-1.5-7b --baseline none \
             --concurrency 32 --num-requests 64 --input-len 24 --output-len 128 --request-timeout 120 \
             --out "$OUT/serve_warm.json" > /dev/null 2>&1
           PYSPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
           [ -x "$PYSPY" ] && "$PYSPY" record -p $S -d 12 -r 250 --threads -f raw -o "$OUT/server_pyspy.txt" > "$OUT/pyspy.err" 2>&1 &
           P=$!
           $bench serve --url http://127.0.0.1:8000 --protocol triton-http --preset llava-1.5-7b --baseline none \
             --concurrency 32 --num-requests 192 --input-len 24 --output-len 128 --request-timeout 120 \
             --out "$OUT/serve_profiled.json" --markdown "$OUT/serve_profiled.md" 2> "$OUT/serve_profiled.err"
           wait $P; kill $S; cat "$OUT/serve_profiled.md" ;;
    tp) # tensor parallelism on two GPUs: one GPU, then two shards with and without CUDA graphs, then the GPU test
        for run in "1 " "2 --enforce-eager" "2 "; do set -- $run; tp=$1; shift
          tag=tp${tp}${1:+_eager}
          timeout 280 $bench latency --preset llava-1.5-7b --batch-sizes 1,8,32 --input-len 24 --output-len 48 \
            --baseline none --tensor-parallel-size "$tp" "$@" --out "$OUT/latency_$tag.json" \
            --markdown "$OUT/latency_$tag.md" > "$OUT/latency_$tag.log" 2>&1
          echo "== $tag (rc $?)"; grep "^| *[0-9]" "$OUT/latency_$tag.md" 2>/dev/null \
            || grep -v "it/s\]" "$OUT/latency_$tag.log" | tail -15; done
        timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_tensor_parallel.py \
          tests/unit/test_tensor_parallel_families.py 2>&1 | tail -5 ;;
    kernels) # the quantized / FP8 / vision-tower kernels: their gpu tests, then each kernel timed per shape
        timeout 400 python3 -m pytest -q -p no:cacheprovider -rf -m gpu tests/gpu/test_w8a8_gpu.py \
          tests/gpu/test_group_int4_gpu.py tests/gpu/test_fp8_swap_ab_gpu.py tests/gpu/test_vision_varlen_gpu.py \
          tests/unit/test_w8a8_fusion.py tests/parity/test_int_checkpoints.py tests/parity/test_fp8_weights.py 2>&1 | tail -8
        for s in quant_kernel_bench fp8_decode_bench vision_tower_profile overlap_probe; do
          timeout 240 python3 scripts/$s.py > "$OUT/$s.txt" 2>&1; echo "== $s (rc $?)"; tail -40 "$OUT/$s.txt"; done ;;
    quant) # issue 33: fp16, FP8, FP8 + FP8 KV, int8, W8A8, int4_g128 in one call (~9 min: alone in a call)
        for v in none fp8 fp8kv int8 w8a8 int4_g128; do
          case $v in none) flag="--baseline none";; fp8kv) flag="--baseline none --quantization fp8 --kv-cache-dtype fp8";;
            *) flag="--baseline none --quantization $v";; esac
          timeout 170 $bench latency --preset llava-1.5-7b --batch-sizes 1,32 --input-len 24 --output-len 64 $flag \
            --out "$OUT/latency_$v.json" --markdown "$OUT/latency_$v.md" > "$OUT/latency_$v.log" 2>&1
          echo "== $v (rc $?)"; grep -E "^\| *(1|32) \||GiB" "$OUT/latency_$v.md"; done ;;
    multinode) # two "nodes" of one GPU each over NCCL (needs two GPUs); its process trees take minutes to start
        timeout 540 python3 -m pytest -v -p no:cacheprovider -rf -m gpu tests/server/test_multinode_tensor_parallel.py \
          > "$OUT/multinode.log" 2>&1; echo "multinode rc $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/multinode.log" ;;
    ba-*) # the preset's random checkpoint written first (minutes on a fresh machine), outside the timed steps' limits
        if [ $step = ba-qwen ]; then preset_dir qwen2.5-vl-7b qwen2_vl; else preset_dir llava-1.5-7b; fi > /dev/null
        for code in . ${BEFORE:-}; do
        tag=${step#ba-}_$([ "$code" = . ] && echo this || echo before); run="env PYTHONPATH=${PYTHONPATH%.}$code $bench"
        date -u +"%H:%M:%SZ $tag"
        case $step in
          ba-throughput) for q in "" "--quantization fp8 --kv-cache-dtype fp8"; do
              timeout 170 $run throughput --preset llava-1.5-7b --num-requests 512 --input-len 128 --output-len 128 \
                --max-num-seqs 128 --baseline none $q --out "$OUT/$tag${q:+_fp8}.json" --markdown "$OUT/$tag${q:+_fp8}.md" \
                > "$OUT/$tag${q:+_fp8}.log" 2>&1; grep "^|" "$OUT/$tag${q:+_fp8}.md"; done ;;
          ba-ttft) timeout 100 $run latency --preset llava-1.5-7b --batch-sizes 1 --input-len 24 --output-len 16 \
              --baseline none --out "$OUT/$tag.json" --markdown "$OUT/$tag.md" > "$OUT/$tag.log" 2>&1; grep "^| 1 " "$OUT/$tag.md" ;;
          ba-int4) timeout 280 env PYTHONPATH=${PYTHONPATH%.}$code python3 scripts/quant_kernel_bench.py \
              --shapes down,qkv,gate_up,o --rows 1,16,32,64 --no-configs > "$OUT/$tag.txt" 2>&1
            grep -E "^[a-z_]+ K=|fp16 F.linear|int4 (linear|GEMV \(auto|GEMM \(auto|GEMM scales)|pick" "$OUT/$tag.txt"
            timeout 150 $run latency --preset llava-1.5-7b --batch-sizes 1,32 --input-len 24 --output-len 64 \
              --baseline none --quantization int4_g128 --out "$OUT/${tag}_latency.json" --markdown "$OUT/${tag}_latency.md" \
              > "$OUT/${tag}_latency.log" 2>&1; grep -E "^\| *(1|32) " "$OUT/${tag}_latency.md" ;;
          ba-qwen) timeout 170 $run latency --family qwen2_vl --preset qwen2.5-vl-7b --image-size 1440 --batch-sizes 1 --input-len 24 \
              --output-len 8 --baseline none --out "$OUT/$tag.json" --markdown "$OUT/$tag.md" > "$OUT/$tag.log" 2>&1
            grep "^| 1 " "$OUT/$tag.md" ;;
          ba-serve) start_llava_server "$OUT/${tag}_server.log" "${PYTHONPATH%.}$code"
            timeout 120 $bench serve --url http://127.0.0.1:8000 --protocol triton-http --preset llava-1.5-7b --baseline none \
              --request-rates '' --concurrency 1 --num-requests 32 --input-len 24 --output-len 128 --request-timeout 60 \
              --out "$OUT/$tag.json" --markdown "$OUT/$tag.md" > "$OUT/$tag.log" 2>&1
            kill $S; wait $S; grep "^|" "$OUT/$tag.md" ;;
        esac; done ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
