#!/usr/bin/env bash
# Builds the git-ignored files user_stack_env.sh carries to the device (see its header), here:
#   tests/benchmarks/user_stack_carry.sh COMFYUI_TREE [FIRST_PART_BYTES] [PART_BYTES]
# COMFYUI_TREE: ComfyUI 0.19.3's tree (git archive 3086026401180c9216bcb6ace442a4e3587d2c66).
# Part sizes: what the call's 64 MiB leave beside the tracked tree (the first call also carries
# .carry/us1, about 1.1 MB). Needs pip with access to the package index.
set -euo pipefail
tree=${1:?ComfyUI 0.19.3 tree}
first=${2:-5600000}
part=${3:-6900000}
repo=$(git rev-parse --show-toplevel)
source "$repo/tests/benchmarks/carry_parts.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
# manylinux2014 too: comfy-aimdo's platform wheel (its native library: DynamicVRAM) is tagged so, and
# with manylinux_2_28 alone pip takes its py3-none-any wheel, which has none
pip download -q --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --only-binary=:all: -d dl \
  comfy-kitchen==0.2.40 comfy-aimdo==0.6.0 torchsde==0.2.6 trampoline==0.1.2 sageattention==1.0.6
mkdir site
for w in dl/*.whl; do (cd site && unzip -q -o "../$w"); done
so=site/comfy_kitchen/backends/cuda/_C.abi3.so
xz -9e -T8 -c "$so" > ck.xz
sum=$(sha256sum "$so" | cut -d' ' -f1)
rm -f "$so" site/comfy_kitchen/backends/hip/_C.abi3.so
mkdir -p site/av/container site/av/subtitles
cat > site/av/__init__.py <<'EOF'
"""A stand-in for PyAV (``av``), carried by tests/benchmarks/user_stack_env.sh.

ComfyUI 0.19.3 imports ``av`` through ``comfy_api.latest`` (video inputs and outputs); sampling never
uses it. The device has no PyAV and its 35 MB wheel does not fit a device call beside the tracked
tree, so benchmark calls carry this module instead: any attribute is a placeholder class, and using
one for real (decoding or encoding video) raises.
"""

__version__ = "0+chorus-stub"
CHORUS_STUB = True


class _Placeholder:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("PyAV is not installed on this machine (the benchmark's stand-in for av)")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    cls = type(name, (_Placeholder,), {})
    globals()[name] = cls
    return cls
EOF
for m in container/__init__.py subtitles/__init__.py subtitles/stream.py logging.py; do
  cat > "site/av/$m" <<'EOF'
from av import _Placeholder


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    cls = type(name, (_Placeholder,), {})
    globals()[name] = cls
    return cls
EOF
done
find site -name __pycache__ -prune -exec rm -rf {} +
rm -rf "$repo"/.carry/us1 "$repo"/.carry/ck*
mkdir -p "$repo/.carry/us1"
excl=(--exclude=./tests --exclude=./tests-unit --exclude=./comfy_api_nodes --exclude=./blueprints
      --exclude='*.pyc' --exclude=__pycache__ --exclude=./comfy/sd1_tokenizer)
for d in ace_lyrics byt5 hydit_clip llama qwen25 qwen35 t5_pile t5; do excl+=(--exclude="./comfy/text_encoders/${d}_tokenizer"); done
tar -C "$tree" "${excl[@]}" -cf - . | xz -9 -T8 > "$repo/.carry/us1/comfyui-0.19.3.tar.xz"
tar -C site -cf - . | xz -9 > "$repo/.carry/us1/site.tar.xz"
# parts: the first smaller (it travels with us1), then equal ones
head -c "$first" ck.xz > p.00
tail -c +"$((first + 1))" ck.xz | split -b "$part" -d -a 2 --numeric-suffixes=1 - p.
n=$(carry_parts "$repo" ck)
echo "$sum $n" > "$repo/.carry/us1/ck.sha256"
ls -la "$repo"/.carry/us1 "$repo"/.carry/ck*
