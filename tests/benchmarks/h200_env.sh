# Sourced at the start of a device call on the H200 (the `device` tool), from the repo root:
#   source tests/benchmarks/h200_env.sh; stage1     # ComfyUI + small wheels; stages cu13 part 1
#   source tests/benchmarks/h200_env.sh; stage2     # next call within ~30 s: FlashAttention-4
# What each call carries (git-ignored; how to build it: the end of this header):
#   stage1: .whl .carry/comfyui.tar.xz .carry/p1      (p1: cu13.part.aa)
#   stage2: .whl .carry/comfyui.tar.xz .carry/p2      (p2: cu13.part.ab + the other FA4 wheels)
# The cutlass-dsl cu13 libraries are split over two calls because together with the tree they
# exceed one call's 64 MiB; the first part waits in /tmp/chorus-stage between the calls.
# The tree carries the entropy16k checkpoint (32 MB, tests/testbed/entropy16k): a stage1 call that
# also carries .carry/p1 (40 MB) goes over 64 MiB, so move that folder out of the checkout for
# that call (mv tests/testbed/entropy16k /tmp/ ... and back after) unless the call needs it.
# product_path --compose (core's EasyCache node) imports PyAV through comfy_api; the device's Python
# has no `av` and its wheel (35 MB) does not fit beside the checkpoint in one call: stage it in a
# call of its own (checkpoint moved out) under /tmp, as the cu13 libraries are: carry .carry/av
# (the wheel: pip download av, cp312 manylinux_2_28) and run `stage_av`; later calls within ~30 s
# find it on PYTHONPATH.
# Building the carried files here: git archive of ComfyUI's pinned commit | xz -> .carry/comfyui.tar.xz;
# pip download (cp312, manylinux) torchsde trampoline sqlite-utils sqlite-fts4 click-default-group -> .whl;
# the FA4 wheels (README, Kernel backends) -> .carry/p2, except the cu13 libs wheel: unzip it,
# tar | xz -9, split -b 40M -> .carry/p1/cu13.part.aa and .carry/p2/cu13.part.ab.

STAGE=/tmp/chorus-stage
export PYTHONUNBUFFERED=1

_install_common() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
  if [ ! -f /tmp/cui/main.py ]; then
    mkdir -p /tmp/cui && tar -xJf .carry/comfyui.tar.xz -C /tmp/cui || return 1
  fi
  export COMFYUI_PATH=/tmp/cui
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  if [ -d /tmp/avsite ]; then export PYTHONPATH=$PYTHONPATH:/tmp/avsite; fi
}

stage_av() {
  _install_common || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/avsite \
    .carry/av/*.whl || return 1
  export PYTHONPATH=$PYTHONPATH:/tmp/avsite
  python3 -c "import av; print('av', av.__version__)"
}

stage1() {
  _install_common || return 1
  mkdir -p "$STAGE"
  if [ -f .carry/p1/cu13.part.aa ]; then cp .carry/p1/cu13.part.aa "$STAGE/"; fi
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
}

stage2() {
  _install_common || return 1
  local fa=/tmp/fa4site
  # the marker is written last: a stage2 that failed part-way is done again, not skipped
  if [ ! -f "$fa/.chorus-complete" ]; then
    local part
    for part in "$STAGE/cu13.part.aa" .carry/p2/cu13.part.ab; do
      [ -f "$part" ] || { echo "stage2: $part missing (stage1 must run in the call just before)"; return 1; }
    done
    rm -rf "$fa" /tmp/cu13 && mkdir -p /tmp/cu13 || return 1
    cat "$STAGE/cu13.part.aa" .carry/p2/cu13.part.ab | xz -d | tar -x -C /tmp/cu13
    [ "${PIPESTATUS[*]}" = "0 0 0" ] || { echo "stage2: unpacking the cu13 libraries failed"; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$fa" .carry/p2/*.whl || return 1
    # the cu13 tree goes over the installed packages; pip --upgrade --target would remove it again
    cp -a /tmp/cu13/. "$fa/" && touch "$fa/.chorus-complete" || return 1
  fi
  export PYTHONPATH=$fa:$fa/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  python3 -c "import flash_attn.cute.interface as f; print('FA4', f.__file__)" || { echo "stage2: FA4 does not import"; return 1; }
}
