# Several product-path runs of one checkpoint side by side on one GPU (the `device` tool's H200).
# The testbed model is small (16 M parameters, 16,384 tokens): one run leaves most of the H200
# idle, so runs that do not depend on each other share it. Each run has its own temporary bank
# and writes its partial table as it goes, so a run cut off by the time limit keeps its rows.
# Seven 10-step runs side by side each went about 2.2x slower than one alone (8 targets x 3 seeds:
# ~180 s alone, ~470 s in seven), so pass SECONDS to fit, or fewer arms, or split by --seed-start.
# A 40-step cfg 5 run is about 8x a 10-step cfg 1 one: split it by seed and by target (--picks 0:3,
# 3:6, 6:8 with --seeds 1 --seed-start S: about 320 s each, six side by side, 2026-12-03) and --merge.
# At most 8 files come back from $OUT, so the runs' folders come back as one $OUT/sweep.tgz
# (2026-12-03 lost four runs' tables by returning them file by file).
# A file over 16 MiB does not come back either: never tar checkpoint parts (15 MiB each) with
# the tables (2026-12-03 lost a schedule-transfer table and a sharpness record that way); return
# the parts as files of their own, the small results in one archive.
#   source tests/benchmarks/h200_env.sh; stage1
#   source tests/benchmarks/product_path_sweep.sh
#   CK=$(joined_checkpoint tests/testbed/entropy16k) || exit 1
#   sweep "$CK" PRESET SECONDS "NAME ARGS..." "NAME ARGS..." ...
#   (results in $OUT/sweep.tgz: NAME/product_path.json, .md, run.log)
# e.g. sweep /tmp/train/chorus_testbed_wan21_i2v.safetensors entropy16k 500 \
#        "natural" "d010 --option min_density=0.10 --option max_density=0.10"

# The checkpoint joined from its committed parts, once per machine: a later call on the same
# machine (within ~30 s) finds it in /tmp; a fresh machine (the run reports warm: false) joins it
# again, and says so plainly when the parts are not in this call's tree (moved out to make room).
#   CK=$(joined_checkpoint tests/testbed/entropy16k) || exit 1
joined_checkpoint() {
  local parts=$1 out=/tmp/chorus-joined/$(basename "$1")
  local checkpoint=$out/chorus_testbed_wan21_i2v.safetensors
  if [ ! -f "$checkpoint" ]; then
    if ! ls "$parts"/*.part1-of-*.safetensors > /dev/null 2>&1; then
      echo "joined_checkpoint: no joined checkpoint in $out and no parts in $parts: carry the parts in this call" >&2
      return 1
    fi
    python3 -m tests.testbed.train --join-parts "$parts" --out "$out" > /dev/null || return 1
  fi
  echo "$checkpoint"
}

sweep() {
  local checkpoint=$1 preset=$2 seconds=$3
  shift 3
  local arm name names=()
  for arm in "$@"; do
    name=${arm%% *}
    names+=("$name")
    [ "$name" = "$arm" ] && arm="" || arm=${arm#* }
    mkdir -p "$OUT/$name"
    # word splitting of $arm is wanted: it holds the run's extra arguments
    # shellcheck disable=SC2086
    timeout "$seconds" python3 -m tests.testbed.product_path --checkpoint "$checkpoint" \
      --preset "$preset" --targets 8 --seeds 3 --out "$OUT/$name" $arm > "$OUT/$name/run.log" 2>&1 &
  done
  wait
  for name in "${names[@]}"; do
    echo "== $name: $(tail -n 1 "$OUT/$name/run.log")"
  done
  tar -czf "$OUT/sweep.tgz" -C "$OUT" "${names[@]}" && rm -rf "${names[@]/#/$OUT/}"
}
