"""Mask codecs measured on masks a recorder actually produced: size, encode time, decode time.

    python tests/benchmarks/bench_codec.py --bank DIR [--out DIR] [--name NAME]

    python tests/benchmarks/bench_codec.py --synthetic 480p [--layers 8] [--out DIR]
    python tests/benchmarks/bench_codec.py --testbed [--out DIR]

Every entry of the bank at DIR (for example the one ``bench_reuse_loop.py --keep-bank DIR``
records at Wan2.1-14B shapes, or a testbed bank) is decoded to its bool block maps and then
re-encoded with each candidate:

- ``packbits-xor-zlib-v1`` (the bank's codec: bucket 0 as packed bits, later buckets as packed
  XOR with bucket 0) at zlib levels 6 (shipped) and 1;
- ``rowshift-zlib-v1`` (the earlier codec, still read) at level 9.

``--synthetic`` measures instead one entry of ``bench_end_to_end.structured_block_map`` masks
(local 3D windows, global key columns, noise; what real video-DiT masks look like, as far as
random-weight runs can show) at density 0.15, 3 step buckets, ``--layers`` layers, 40 heads.

``--testbed`` records one entry the way a user's miss does (``ReusePatch`` with recording, the
background writer, a real bank in a temporary folder) on the committed testbed checkpoint
(a trained Wan2.1-I2V-architecture model, ``tests/testbed/``) at its long training size,
16 x 64 x 64 latents = 16,384 tokens, on the CPU, and measures the codecs on that entry.

Decode is timed to bool maps for every (bucket, layer), and for the shipped codec also as a hit's
prefetch worker does it: packed bits and row counts on the host (``hit_host_ms``; the live-block
lists are built on the GPU since 2026-12-02; results before that timed host live lists instead). Writes ``codec_<name>.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "benchmarks"))

from chorus_core.bank import MaskBank  # noqa: E402
from chorus_core.bank.encoding import PACKBITS, ROWSHIFT, decode_block_map, decode_packed_block_map, encode_masks  # noqa: E402,E501
from chorus_core.reuse.entry_prefetch import HostLayer  # noqa: E402


def codec_at(codec: str, level: int):
    def encode(maps):
        return encode_masks(maps, level=level, codec=codec)

    def decode(tensors, meta, shape):
        return [decode_block_map(tensors, meta, s, l) for s in range(shape[0]) for l in range(shape[1])]

    return encode, decode


CANDIDATES = {
    "packbits-xor-zlib-v1 (level 6, shipped)": codec_at(PACKBITS, 6),
    "packbits-xor-zlib-v1 (level 1)": codec_at(PACKBITS, 1),
    "rowshift-zlib-v1 (level 9, the earlier codec)": codec_at(ROWSHIFT, 9),
}


def entry_maps(bank: MaskBank, entry_id: str) -> np.ndarray:
    entry = bank.load_masks(entry_id, record_hit=False)
    s_count, layers = len(entry.step_buckets), entry.shape[1]
    return np.stack([np.stack([entry.block_map(s, l).numpy() for l in range(layers)]) for s in range(s_count)])


def synthetic_maps(shape: str, layers: int) -> np.ndarray:
    from bench_end_to_end import SHAPES, structured_block_map, token_grid

    grid = token_grid(SHAPES[shape])
    return np.stack([np.stack([structured_block_map(grid, 40, 0.15, seed=1000 * b + l, device="cpu")[0].numpy()
                               for l in range(layers)]) for b in range(3)])


def testbed_maps(steps: int = 6) -> np.ndarray:
    import tempfile

    from chorus_core.comfy.comfyui_locator import locate_comfyui, prepare_in_process

    prepare_in_process(locate_comfyui(allow_clone=False), cpu=True)
    import comfy.sample
    import comfy.sd

    from chorus_core.reuse import bank_writer
    from chorus_core.bank.signature import resolve_weights
    from chorus_core.reuse.reuse_run import ReuseOptions, ReusePatch
    from chorus_core.reuse.reuse_match import build_match_request, match_request
    from chorus_core.testbed.workload import I2VRequest, generate_request, i2v_conditioning

    patcher = comfy.sd.load_diffusion_model(str(REPO / "tests" / "testbed" / "chorus_testbed_wan21_i2v.safetensors"))
    positive, negative, latent = i2v_conditioning(generate_request(I2VRequest(frames=16, height=64, width=64)))
    with tempfile.TemporaryDirectory() as tmp:
        bank = MaskBank.open(tmp)
        request = build_match_request(patcher, positive[0][1]["clip_vision_output"], positive, latent, None, 0.9,
                                      resolve_weights(None), 128)
        patch = ReusePatch(patcher, match_request(bank, request), ReuseOptions(), scheduler="simple")
        patched = patch.install()
        noise = comfy.sample.prepare_noise(latent["samples"], 0)
        comfy.sample.sample(patched, noise, steps, 5.0, "euler", "simple", positive, negative, latent["samples"],
                            seed=0, disable_pbar=True)
        report = patch.last_report
        if not bank_writer.flush_all(timeout=600) or bank.stats()["entries"] != 1:
            raise RuntimeError(f"the testbed recording was not written: {report.warnings}")
        return entry_maps(bank, report.recorded_entry_id)


def measure(maps: np.ndarray) -> list[dict]:
    rows = []
    for name, (encode, decode) in CANDIDATES.items():
        started = time.perf_counter()
        tensors, meta = encode(maps)
        encode_s = time.perf_counter() - started
        started = time.perf_counter()
        decoded = decode(tensors, meta, maps.shape)
        decode_s = time.perf_counter() - started
        flat = maps.reshape(-1, *maps.shape[2:])
        assert all(np.array_equal(d, flat[i]) for i, d in enumerate(decoded)), f"{name} is not lossless"
        row = {"codec": name, "entry_bytes": int(sum(t.nbytes for t in tensors.values())),
               "encode_s": round(encode_s, 3), "decode_ms": round(decode_s * 1e3, 1)}
        if "shipped" in name:
            row["hit_host_ms"] = hit_host_ms(tensors, meta, maps.shape)
            row["host_live_lists_ms"] = host_live_lists_ms(tensors, meta, maps.shape)
        rows.append(row)
    return rows


def hit_host_ms(tensors, meta, shape) -> float:
    """A hit's host work for the whole entry: packed bits and row counts of every (bucket, layer)."""
    started = time.perf_counter()
    for s in range(shape[0]):
        for layer in range(shape[1]):
            HostLayer.from_packed(decode_packed_block_map(tensors, meta, s, layer), shape[-1], pin=False)
    return round((time.perf_counter() - started) * 1e3, 1)


def host_live_lists_ms(tensors, meta, shape) -> float:
    """What a hit's worker did on the host before 2026-12-02, for comparison: every (bucket, layer)
    decoded to bool maps and turned into padded live-block lists with numpy."""
    started = time.perf_counter()
    for s in range(shape[0]):
        for layer in range(shape[1]):
            live = decode_block_map(tensors, meta, s, layer)
            counts = live.sum(-1, dtype=np.int32)
            flat = np.flatnonzero(live)
            rows, cols = np.divmod(flat, live.shape[-1])
            per_row = counts.ravel()
            slots = np.arange(flat.size) - np.repeat(np.cumsum(per_row) - per_row, per_row)
            ids = np.zeros((per_row.size, int(per_row.max(initial=1))), dtype=np.int16)
            ids[rows, slots] = cols
    return round((time.perf_counter() - started) * 1e3, 1)


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} host, {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})"
    except Exception:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--bank", help="a bank whose entries were recorded")
    source.add_argument("--synthetic", choices=("480p", "720p"), help="structured synthetic masks instead")
    source.add_argument("--testbed", action="store_true", help="record one entry on the testbed checkpoint (CPU)")
    parser.add_argument("--layers", type=int, default=8, help="layers of the synthetic entry")
    parser.add_argument("--out", default=str(REPO / "tests" / "benchmarks" / "results"))
    parser.add_argument("--name", default="recorded")
    parser.add_argument("--shape", default="", help="label for the rows, e.g. 720p")
    args = parser.parse_args(argv)
    rows = []
    sources = [(args.synthetic, "synthetic", synthetic_maps(args.synthetic, args.layers))] if args.synthetic else []
    if args.testbed:
        sources = [("testbed 16x64x64", "recorded", testbed_maps())]
    if args.bank:
        with MaskBank.open(args.bank, read_only=True) as bank:
            sources = [(args.shape, e["id"], entry_maps(bank, e["id"])) for e in bank.entries()]
    for shape, entry, maps in sources:
        for row in measure(maps):
            rows.append({"shape": shape, "entry": entry, "masks": "x".join(map(str, maps.shape)),
                         "density": round(float(maps.mean()), 4), **row})
            print(json.dumps(rows[-1]))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    doc = {"benchmark": "bench_codec", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(),
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "git_commit": commit or None, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"codec_{args.name}.json").write_text(json.dumps(doc, indent=2))
    lines = [f"# Mask codecs on recorded masks ({args.name})", "", f"{doc['machine']}; `{doc['command']}`; {doc['date']}", "",
             "| shape | masks | density | codec | entry bytes | encode s | decode ms | hit host ms | before: host live lists ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['masks']} | {r['density']} | {r['codec']} | {r['entry_bytes']:,} | "
                     f"{r['encode_s']} | {r['decode_ms']} | {r.get('hit_host_ms', '')} | {r.get('host_live_lists_ms', '')} |")
    (out / f"codec_{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
