"""Small shared fixtures of the mask bank tests: a toy model, layout, schedule and masks."""

import sys
import time

import numpy as np

from chorus_core.bank import LatentLayout, MaskBank, ModelFingerprint, Schedule, build_signature


def toy_state_dict(dim=256, layers=2, seed=0, in_dim=36):
    """A Wan-shaped state dict (only the keys the fingerprint reads), with random values."""
    import torch  # only here: the writer subprocesses stay light

    g = torch.Generator().manual_seed(seed)
    state = {"patch_embedding.weight": torch.randn(dim, in_dim, 1, 2, 2, generator=g),
             "head.modulation": torch.randn(1, 2, dim, generator=g)}
    for i in range(layers):
        for name in ("q", "k"):
            state[f"blocks.{i}.self_attn.{name}.weight"] = torch.randn(dim, dim, generator=g)
    return state


FP = ModelFingerprint("wan2.1-i2v", dim=256, layers=2, heads=2, in_dim=36, digest="0" * 64)
LAYOUT = LatentLayout(grid=(2, 8, 16), token_order="thw", block_size=(32, 32))  # 8 x 8 blocks
SCHEDULE = Schedule(steps=8, sampler="uni_pc", scheduler="simple", shift=5.0,
                    step_buckets=[(0, 2), (2, 5), (5, 8)])


def toy_masks(seed=0, density=0.3):
    """Random bool masks [S=3, L=2, H=2, 8, 8] with the diagonal always kept."""
    rng = np.random.default_rng(seed)
    masks = rng.random((3, 2, 2, 8, 8)) < density
    masks |= np.eye(8, dtype=bool)
    return masks


def toy_signature(seed=0, noise=0.0, base_seed=None):
    """Signature from random CLIP hidden states / text / latent; ``noise`` perturbs a base."""
    rng = np.random.default_rng(seed if base_seed is None else base_seed)
    clip = rng.standard_normal((1, 257, 1280)).astype(np.float32)
    text = rng.standard_normal((1, 12, 4096)).astype(np.float32)
    latent = rng.standard_normal((16, 3, 8, 16)).astype(np.float32)
    if noise:
        rn = np.random.default_rng(seed + 1000)
        clip += noise * rn.standard_normal(clip.shape).astype(np.float32)
        text += noise * rn.standard_normal(text.shape).astype(np.float32)
        latent += noise * rn.standard_normal(latent.shape).astype(np.float32)
    return build_signature(clip_vision=clip, text=text, start_latent=latent)


def add_toy(bank, seed=0, tags=(), sig=None, fp=FP, layout=LAYOUT):
    return bank.add_entry(fingerprint=fp, layout=layout, schedule=SCHEDULE,
                          masks=toy_masks(seed), signature=sig or toy_signature(seed),
                          density=0.3, recall=0.95, tags=list(tags))


def corrupt(bank, entry, how):
    """Damage an entry's blob where its backend keeps it (file, or bytea row)."""
    row = bank.show(entry)
    if bank.root is not None:
        path = bank.blob_path(row["blob_name"])
        data = path.read_bytes()
        if how == "missing":
            path.unlink()
        else:
            path.write_bytes(data[: len(data) // 2] if how == "truncate"
                             else data[:-1] + bytes([data[-1] ^ 0xFF]))
        return
    sha = row["blob_sha256"]
    if how == "missing":
        bank.db.execute("DELETE FROM blobs WHERE sha256 = ?", [sha])
        return
    data = bank.db.query("SELECT data FROM blobs WHERE sha256 = ?", [sha])[0]["data"]
    data = data[: len(data) // 2] if how == "truncate" else data[:-1] + bytes([data[-1] ^ 0xFF])
    bank.db.execute("UPDATE blobs SET data = ? WHERE sha256 = ?", [data, sha])


def prune_least_recently_used(bank) -> list:
    """The eviction order and pruning every bank backend must give (shared by the SQLite folder
    bank's and the PostgreSQL bank's tests); returns the four entry ids, of which ids[0] is left."""
    ids = [add_toy(bank, seed=s) for s in range(4)]
    now = time.time()
    # (created, last_hit, hits): ids[1] is the oldest use; ids[2] and ids[3] tie on last use
    times = {ids[0]: (now - 50, now - 10, 5), ids[1]: (now - 40, None, 0),
             ids[2]: (now - 30, now - 20, 1), ids[3]: (now - 35, now - 20, 3)}
    for entry, (created, last_hit, hits) in times.items():
        bank.db.execute("UPDATE entries SET created=?, last_hit=?, hits=? WHERE id=?",
                        [created, last_hit, hits, entry])
    assert [r["id"] for r in bank.eviction_order()] == [ids[1], ids[2], ids[3], ids[0]]
    assert bank.prune(max_entries=2, dry_run=True) == [ids[1], ids[2]]
    assert bank.prune(max_bytes=bank.show(ids[0])["blob_bytes"]) == [ids[1], ids[2], ids[3]]
    assert [r["id"] for r in bank.entries()] == [ids[0]]
    return ids


def writer_main(path, count, seed, pause=0.0):
    """Subprocess body: add ``count`` entries (forever when count < 0), then exit."""
    bank = MaskBank.open(path)
    i = 0
    while count < 0 or i < count:
        add_toy(bank, seed=seed * 100_000 + i, tags=[f"writer{seed}"])
        print(i, flush=True)
        i += 1
        time.sleep(pause)


def writer_command(path, count, seed):
    """argv that runs :func:`writer_main` in a fresh interpreter."""
    code = ("import sys; sys.path.insert(0, 'tests'); from bank_fixtures import writer_main; "
            f"writer_main({str(path)!r}, {count}, {seed})")
    return [sys.executable, "-c", code]


# ---- subprocess bodies of the hostile suite (tests/test_bank_hostile.py) -----------------
def victim_main(action, path, arg=""):
    """One bank operation, run with CHORUS_BANK_FAULT set so it dies at that point."""
    bank = MaskBank.open(path)
    if action == "add":
        add_toy(bank, seed=int(arg or 0))
    elif action == "prune":
        bank.prune(max_entries=int(arg))
    elif action == "quarantine":
        bank.quarantine(arg, "test")
    elif action == "import":
        bank.import_file(arg)
    print("survived", flush=True)


def role_main(role, path, seconds, out):
    """Concurrency roles: writer re-adds 4 fixed mask sets (same blobs again and again),
    pruner keeps 2 entries, reader matches and loads, verifier verifies; each writes
    ``{"ops": n, "corrupt": [...], "errors": [...]}`` to ``out`` as JSON."""
    import json

    from chorus_core.bank import BankEntryCorrupt, BankError

    bank = MaskBank.open(path)
    result = {"ops": 0, "corrupt": [], "errors": []}
    end = time.time() + seconds
    while time.time() < end:
        try:
            if role.startswith("writer"):
                add_toy(bank, seed=result["ops"] % 4)
            elif role == "pruner":
                bank.prune(max_entries=2)
            elif role == "reader":
                hit = bank.match(toy_signature(result["ops"] % 4), FP, LAYOUT, threshold=0.0)
                if hit.entry_id:
                    bank.load_masks(hit.entry_id).block_map_numpy(2, 1)
            else:
                report = bank.verify()
                result["corrupt"] += report["quarantined"]
        except BankEntryCorrupt as exc:
            result["corrupt"].append(str(exc))
        except BankError as exc:  # "No entry": pruned between match and load, expected
            if "No entry" not in str(exc):
                result["errors"].append(str(exc))
        result["ops"] += 1
    with open(out, "w") as fh:
        json.dump(result, fh)


def python_command(body):
    """argv running ``body`` (Python source) with tests/ importable."""
    return [sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); " + body]
