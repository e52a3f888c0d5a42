#!/usr/bin/env bash
# Builds the git-ignored FlashAttention-4 parts that user_stack_env.sh's us_fa4 assembles on the
# device (the :fa4 rows of bench_user_stack.py), here:
#   tests/benchmarks/user_stack_fa4_carry.sh [PART_BYTES]
# FA4 needs nvidia-cutlass-dsl's CUDA 13 libraries (a 92 MB wheel, 227 MB unpacked): they travel
# unpacked and xz'd (64 MB), in parts of PART_BYTES (default 54,000,000: what a call's 64 MiB leave beside
# the tracked tree with the testbed checkpoints moved out), one part a call, on a warm machine
# (us_stage keeps them in /tmp/us-stage between calls); the other FA4 wheels (10 MB) travel with
# the last part, which is small enough to go with the first call's .carry/us1 and .carry/ck1; the
# device's Python has torch, einops, protobuf and cuda-bindings already.
#   .carry/faN/fa.part.NN   the parts; .carry/fa1/fa.sha256: the xz stream's sha256 and part count
#   .carry/faLAST/*.whl     flash-attn-4 and the rest of its wheels
# Needs pip with access to the package index.
set -euo pipefail
part=${1:-54000000}
repo=$(git rev-parse --show-toplevel)
source "$repo/tests/benchmarks/carry_parts.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
pip download -q --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all: -d dl \
  flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 \
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
mkdir cu13
(cd cu13 && unzip -q ../dl/nvidia_cutlass_dsl_libs_cu13-*.whl)
rm dl/nvidia_cutlass_dsl_libs_cu13-*.whl
tar -C cu13 -cf - . | xz -9 -T2 > cu13.tar.xz
sum=$(sha256sum cu13.tar.xz | cut -d' ' -f1)
split -b "$part" -d -a 2 cu13.tar.xz p.
rm -rf "$repo"/.carry/fa[0-9]*
n=$(carry_parts "$repo" fa)
echo "$sum $n" > "$repo/.carry/fa1/fa.sha256"
mv dl/*.whl "$repo/.carry/fa$n/"
du -sh "$repo"/.carry/fa[0-9]*
