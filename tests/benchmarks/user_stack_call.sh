#!/usr/bin/env bash
# One device call of the user-stack benchmark, after user_stack_env.sh's us_base ran on the machine:
#   US_TEST=1 US_SHAPE=640x640 US_TAG=c6 US_ROWS=... bash tests/benchmarks/user_stack_call.sh
# Stages this call's comfy-kitchen part, assembles the library when all parts are in, waits for the
# background weights build (us_base's call started it), runs tests/test_fp8_gpu.py when US_TEST=1,
# then the benchmark with what is left of the call (US_LIMIT, default 575 s, less what ran before).
# Everything it writes goes under $OUT: test_fp8_gpu.log, bench_<tag>.log and the results files.
source tests/benchmarks/user_stack_env.sh
us_stage > /dev/null
us_ready || exit 1
WD=$(cat /tmp/us-wd)
while kill -0 "$(cat /tmp/us-build.pid)" 2> /dev/null; do sleep 3; done
echo "weights build, after ${SECONDS} s of this call:"; tail -3 /tmp/us-build.log; ls -la "$WD"
if [ "${US_TEST:-0}" = 1 ]; then
  CHORUS_TEST_GPU=1 timeout "${US_TEST_LIMIT:-240}" python3 -m pytest tests/test_fp8_gpu.py -x -q -p no:cacheprovider \
    > "$OUT/test_fp8_gpu.log" 2>&1
  echo "test_fp8_gpu rc=$? after ${SECONDS} s"; tail -25 "$OUT/test_fp8_gpu.log"
fi
limit=$(( ${US_LIMIT:-575} - SECONDS ))
python3 tests/benchmarks/bench_user_stack.py --out "$OUT" --weights-dir "$WD" --shape "${US_SHAPE:-640x640}" \
  --tag "${US_TAG:-call}" --call-limit-s "$limit" --budget-s "$limit" ${US_ROWS:+--rows "$US_ROWS"} \
  --git-commit "${US_COMMIT:-unknown}" ${US_EXTRA:-} > "$OUT/bench_${US_TAG:-call}.log" 2>&1
echo "bench rc=$? after ${SECONDS} s"
grep -v "^WARNING:root" "$OUT/bench_${US_TAG:-call}.log" | tail -40
nvidia-smi --query-gpu=name --format=csv,noheader
