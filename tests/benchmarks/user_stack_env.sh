# ComfyUI 0.19.3 (the release users run) on the device machine, for bench_user_stack.py and
# tests/test_fp8_gpu.py. Sourced from the repo root at the start of each device call:
#
#   source tests/benchmarks/user_stack_env.sh; us_stage; us_base      # call 1: + probe, weights build
#   source tests/benchmarks/user_stack_env.sh; us_stage               # calls 2..n: one part each
#   source tests/benchmarks/user_stack_env.sh; us_stage; us_ready     # the call with the last part
#
# Why the parts: the tracked tree is about 56 MiB of the call's 64 MiB, so a call carries 7-8 MB of
# ignored files at most. comfy-kitchen 0.2.40's wheel (67.8 MB; 0.19.3 runs every fp8 linear layer
# through its QuantizedTensor) goes without its ROCm library (158 MB unpacked, unused on NVIDIA);
# its CUDA library (41 MB, 33.5 MB as xz) travels in parts of under 7 MB, one part a call, kept in
# /tmp/us-stage between calls (a warm machine keeps /tmp for ~30 s after a call: send the calls back
# to back). What each call carries (git-ignored, /.carry/):
#   .carry/us1/comfyui-0.19.3.tar.xz  git archive of 3086026401180c9216bcb6ace442a4e3587d2c66 without
#                                      tests, comfy_api_nodes, blueprints and tokenizer data (0.9 MB)
#   .carry/us1/site.tar.xz             comfy_kitchen 0.2.40 (Python part), comfy_aimdo 0.6.0 (its
#                                      platform wheel, native library included: the bench's
#                                      --dynamic-vram turns DynamicVRAM on as a server's main.py
#                                      does; in-process ComfyUI leaves it off), torchsde 0.2.6,
#                                      trampoline 0.1.2, sageattention 1.0.6 (Triton; the :sage rows),
#                                      and a stand-in for PyAV (av/__init__.py says
#                                      why: comfy_api imports av, sampling never uses it)
#   .carry/us1/ck.sha256               the CUDA library's sha256 and part count
#   .carry/ckN/ck.part.NN              the parts of comfy_kitchen/backends/cuda/_C.abi3.so, xz
# Building them here: tests/benchmarks/user_stack_carry.sh.

US_STAGE=/tmp/us-stage
US_SITE=/tmp/us-site
US_COMFY=/tmp/cui193
export PYTHONUNBUFFERED=1

us_stage() {  # keep this call's parts for the call that assembles them
  mkdir -p "$US_STAGE"
  local f
  for f in .carry/ck*/ck.part.* .carry/us1/ck.sha256 .carry/fa[0-9]*/fa.part.* .carry/fa1/fa.sha256 .carry/fa[0-9]*/*.whl; do
    [ -f "$f" ] && cp "$f" "$US_STAGE/"
  done
  ls "$US_STAGE"
}

us_base() {  # ComfyUI and the small packages; the machine's own packages stay first on the path
  if [ ! -f "$US_COMFY/main.py" ]; then
    mkdir -p "$US_COMFY" && tar -xJf .carry/us1/comfyui-0.19.3.tar.xz -C "$US_COMFY" || return 1
  fi
  if [ ! -d "$US_SITE/comfy_kitchen" ]; then
    mkdir -p "$US_SITE" && tar -xJf .carry/us1/site.tar.xz -C "$US_SITE" || return 1
  fi
  export COMFYUI_PATH=$US_COMFY
  export PYTHONPATH=$US_SITE${PYTHONPATH:+:$PYTHONPATH}
}

us_env() {  # a later call: what us_base set up is still in /tmp
  export COMFYUI_PATH=$US_COMFY
  export PYTHONPATH=$US_SITE${PYTHONPATH:+:$PYTHONPATH}
  [ -f "$US_COMFY/main.py" ] && [ -d "$US_SITE/comfy_kitchen" ]
}

us_ready() {  # assemble comfy-kitchen's CUDA library from the staged parts, check it, import it
  us_env || { echo "us_ready: us_base did not run on this machine"; return 1; }
  local so=$US_SITE/comfy_kitchen/backends/cuda/_C.abi3.so
  if [ ! -f "$so" ]; then
    read -r sum parts < "$US_STAGE/ck.sha256" || { echo "us_ready: no ck.sha256 staged"; return 1; }
    local have
    have=$(ls "$US_STAGE"/ck.part.* 2>/dev/null | wc -l)
    [ "$have" = "$parts" ] || { echo "us_ready: $have of $parts parts staged"; return 1; }
    cat "$US_STAGE"/ck.part.* | xz -d > "$so.tmp" || return 1
    echo "$sum  $so.tmp" | sha256sum -c --quiet || { echo "us_ready: checksum differs"; rm -f "$so.tmp"; return 1; }
    mv "$so.tmp" "$so"
  fi
  python3 -c "import comfy_kitchen as ck; print('comfy_kitchen', {k: v['available'] or v['unavailable_reason'] for k, v in ck.list_backends().items()})"
}

US_FA4=/tmp/us-fa4

us_fa4() {  # FlashAttention-4 for the :fa4 rows, once its parts are staged (user_stack_fa4_carry.sh)
  if [ ! -f "$US_FA4/.chorus-complete" ]; then  # written last: a failed assembly is done again
    read -r sum parts < "$US_STAGE/fa.sha256" || { echo "us_fa4: no fa.sha256 staged"; return 1; }
    local have
    have=$(ls "$US_STAGE"/fa.part.* 2>/dev/null | wc -l)
    [ "$have" = "$parts" ] || { echo "us_fa4: $have of $parts parts staged"; return 1; }
    echo "$sum  -" > /tmp/us-fa4.sha256
    cat "$US_STAGE"/fa.part.* | sha256sum -c --quiet /tmp/us-fa4.sha256 || { echo "us_fa4: checksum differs"; return 1; }
    rm -rf "$US_FA4" && mkdir -p "$US_FA4" || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$US_FA4" \
      "$US_STAGE"/*.whl || return 1
    # the CUDA 13 libraries go over the installed packages (pip --target would replace their folder)
    cat "$US_STAGE"/fa.part.* | xz -d | tar -x -C "$US_FA4" || return 1
    touch "$US_FA4/.chorus-complete"
  fi
  export PYTHONPATH=$US_FA4:$US_FA4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  python3 -c "import flash_attn.cute.interface as f; print('FA4', f.__file__)" || { echo "us_fa4: FA4 does not import"; return 1; }
}

us_weights_dir() {  # the checkpoint files need about 50 GB: where an earlier call wrote any of
  # them (the bench writes only the files its rows load, and adds the others beside them), else /tmp
  # when its disk has room, else /dev/shm. 2026-12-06: the files an earlier call left in /tmp took
  # the room, the next call picked /dev/shm and wrote them again (85 s); 2026-12-07: a call that had
  # written the bf16 file alone to /tmp was not found by a test for both files (48 s)
  local free d
  for d in ${US_WEIGHTS_DIRS:-/tmp/us-weights /dev/shm/us-weights}; do
    if ls "$d"/*.safetensors > /dev/null 2>&1; then echo "$d"; return; fi
  done
  free=$(df -B1G --output=avail /tmp | tail -1 | tr -d ' ')
  if [ "${free:-0}" -ge 56 ]; then echo /tmp/us-weights; else echo /dev/shm/us-weights; fi
}

us_probe() {
  nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
  df -h /tmp /dev/shm | cat
  free -g | head -2
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'triton', triton.__version__)"
}
