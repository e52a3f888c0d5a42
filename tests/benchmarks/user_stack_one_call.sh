#!/usr/bin/env bash
# The user-stack benchmark in device calls that each carry everything they need (no staging over
# several calls): the testbed checkpoints (49 MB of the tracked tree) are moved out of the checkout
# for the call, which leaves room for comfy-kitchen's whole CUDA library in one part:
#   tests/benchmarks/user_stack_carry.sh COMFYUI_0.19.3_TREE 40000000 40000000   # .carry/us1, .carry/ck1
#   mkdir -p /tmp/held && git ls-files 'tests/testbed/*.safetensors' | xargs -I{} mv {} /tmp/held/...  (then put back)
#   US_SHAPE=640x640 US_TAG=d1 US_ROWS=... US_COMMIT=$(git rev-parse --short HEAD) \
#     bash tests/benchmarks/user_stack_one_call.sh          # carry: .carry/us1 .carry/ck1
# A later call on the same warm machine finds ComfyUI, comfy-kitchen and the weights in /tmp and needs
# no carry, except FlashAttention-4's parts (.carry/faN, one a call: user_stack_fa4_carry.sh).
# US_TESTS: GPU test files to run first (CHORUS_TEST_GPU=1). Results and logs go to $OUT.
source tests/benchmarks/user_stack_env.sh
us_stage > /dev/null
us_env || us_base || exit 1
us_ready || exit 1
# FlashAttention-4 (the :fa4 rows) once all its parts are staged (user_stack_fa4_carry.sh); until
# then a :fa4 row fails with the reason and the others run. With FA4 importable, Chorus's rows use it
# too where it applies (their backend says so).
if [ -f "$US_STAGE/fa.sha256" ]; then us_fa4 || echo "FA4 not ready: its rows will fail"; fi
WD=$(us_weights_dir)
echo "$WD" > /tmp/us-wd
for t in ${US_TESTS:-}; do
  CHORUS_TEST_GPU=1 timeout "${US_TEST_LIMIT:-120}" python3 -m pytest "$t" -q -s -p no:cacheprovider \
    > "$OUT/$(basename "$t" .py).log" 2>&1
  echo "$t rc=$? after ${SECONDS} s"; grep -E "passed|failed|cosine|rms error" "$OUT/$(basename "$t" .py).log" | tail -8
done
bench() {  # TAG ROWS EXTRA: one bench process with what is left of US_LIMIT
  local limit=$(( ${US_LIMIT:-585} - SECONDS ))
  python3 tests/benchmarks/bench_user_stack.py --out "$OUT" --weights-dir "$WD" --shape "${US_SHAPE:-640x640}" \
    --tag "$1" --call-limit-s "$limit" --budget-s "$limit" ${2:+--rows "$2"} \
    --git-commit "${US_COMMIT:-unknown}" $3 > "$OUT/bench_$1.log" 2>&1
  echo "bench $1 rc=$? after ${SECONDS} s"
  grep -v "^WARNING:root" "$OUT/bench_$1.log" | grep -v "^\[.*name=" | tail -30 | cut -c1-400
}
bench "${US_TAG:-call}" "${US_ROWS:-}" "${US_EXTRA:-}"
# US_THEN_TAG: a second bench process on the same machine (its own US_THEN_ROWS, US_THEN_EXTRA), e.g.
# the same rows on the legacy loader after a --dynamic-vram run: a memory manager is per process.
# Where it repeats a miss row, give it a bank of its own (US_THEN_EXTRA="--bank /tmp/us-bank-2"):
# the first process's entry would make that miss a hit.
# The first process may use the whole US_LIMIT: give it a smaller --budget-s in US_EXTRA to leave time.
if [ -n "${US_THEN_TAG:-}" ]; then
  if [ $(( ${US_LIMIT:-585} - SECONDS )) -lt 60 ]; then echo "bench $US_THEN_TAG not run: under 60 s left"
  else bench "$US_THEN_TAG" "${US_THEN_ROWS:-}" "${US_THEN_EXTRA:-}"; fi
fi
nvidia-smi --query-gpu=name --format=csv,noheader
