"""Command line: ``python -m chorus_core.bank {init,stats,list,show,verify,prune,budget,merge,export,import} PATH``.

PATH is a bank folder, or a PostgreSQL bank URL ``postgresql://USER@HOST:PORT/DB?schema=NAME``
(give the password through PGPASSWORD or ~/.pgpass, not on the command line: other users of
the machine can read command lines). Output never shows a URL's password.

Commands that write (init, verify, prune, import) first replay the recordings a stopped ComfyUI
left in the bank's spool, as a ComfyUI start does; ``stats`` counts them. A folder bank's spool
is in its folder. A PostgreSQL bank's spool is local to the machine, where ComfyUI keeps it:
``<ComfyUI>/models/chorus_banks/.postgres-spool``, found by itself when this pack is installed
in ``<ComfyUI>/custom_nodes``; else give --comfyui DIR (ComfyUI's folder, or its
--base-directory). CHORUS_SPOOL_ROOT, when set, wins over both (as it does in ComfyUI); with
none of these, ``~/.cache/chorus/spool``.

Exit codes: 0 done; 1 ``verify`` quarantined or repaired something (a spool file too); 2 the command could not
run (the message on stderr says why and what to do). No command prints a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import warnings

from . import MaskBank, spool
from .errors import BankError

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)I?B?")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m chorus_core.bank", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def cmd(name, help_):
        c = sub.add_parser(name, help=help_)
        c.add_argument("path", help="bank folder (holds bank.sqlite and blobs/) or "
                                    "postgresql://USER@HOST:PORT/DB?schema=NAME")
        c.add_argument("--json", action="store_true", help="print JSON")
        c.add_argument("--comfyui", metavar="DIR",
                       help="the ComfyUI folder (or --base-directory) whose spool of PostgreSQL banks "
                            "to replay; default: the ComfyUI this pack is installed in")
        return c

    cmd("init", "create an empty bank (or migrate an old one)")
    cmd("stats", "entries, bytes, hits, schema version")
    c = cmd("list", "entries, newest first")
    c.add_argument("--tag")
    c.add_argument("--limit", type=_count, default=50)
    cmd("show", "one entry").add_argument("entry_id")
    cmd("verify", "recompute every blob digest; quarantine failures (exit 1 if any)")
    c = cmd("prune", "evict least recently used entries until the limits hold")
    c.add_argument("--max-bytes", type=_size, help="e.g. 20G, 500M, 1048576 (positive)")
    c.add_argument("--max-entries", type=_count, help="a positive whole number")
    c.add_argument("--dry-run", action="store_true")
    c = cmd("budget", "show the bank's size budget, or set it: stored in the bank, kept by every writer")
    c.add_argument("--max-bytes", type=_size, help="e.g. 20G (a limit not given is removed)")
    c.add_argument("--max-entries", type=_count, help="a positive whole number")
    c.add_argument("--unlimited", action="store_true", help="remove the budget")
    c = cmd("merge", "show the bank's merge policy, or set it: a recording close to an entry updates it "
                     "instead of adding one (off by default; docs/mask-bank.md gives the measured thresholds)")
    c.add_argument("--similarity", type=_share, help="least signature similarity, e.g. 0.65")
    c.add_argument("--agreement", type=_share, help="least mask agreement, e.g. 0.55")
    c.add_argument("--off", action="store_true", help="never merge (the default)")
    c = cmd("export", "write entries and blobs to one tar file")
    c.add_argument("file")
    c.add_argument("--tag")
    c.add_argument("--id", action="append", dest="ids")
    cmd("import", "add the entries of an export file").add_argument("file")
    return p


def _size(text: str) -> int:
    """``500M``, ``20G``, ``1048576`` -> bytes; zero, negative, NaN and infinite are refused."""
    match = _SIZE.fullmatch(text.strip().upper())
    value = float(match[1]) * _UNITS[match[2]] if match else math.nan
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive size; write e.g. 20G, 500M or 1048576 (bytes)")
    return int(value)


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share in (0, 1], e.g. 0.65")
    return value


def _count(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def _use_comfyui_spool(comfyui) -> None:
    """Spool PostgreSQL banks where that ComfyUI does (CHORUS_SPOOL_ROOT still wins, as in ComfyUI)."""
    if comfyui is not None and not os.path.isdir(comfyui):
        raise BankError(f"--comfyui {comfyui} is not a folder; give ComfyUI's folder (or its --base-directory).")
    comfyui = comfyui or spool.installed_comfyui()
    if comfyui is not None:
        spool.set_local_spool_root(spool.comfyui_spool_root(comfyui))


def _run(args) -> object:
    read_only = args.command in ("stats", "list", "show", "export")
    _use_comfyui_spool(args.comfyui)
    with MaskBank.open(args.path, read_only=read_only, create=args.command == "init") as bank:
        replayed = None if read_only else _replay_spool(bank)
        if args.command == "stats":
            return {**bank.stats(), "spooled": spool.spooled_count(bank)}
        if args.command == "init":
            return bank.stats()
        if args.command == "list":
            return bank.entries(tag=args.tag, limit=args.limit)
        if args.command == "show":
            return bank.show(args.entry_id)
        if args.command == "verify":
            return {**bank.verify(), "spool": replayed}
        if args.command == "prune":
            if args.max_bytes is None and args.max_entries is None:
                raise BankError("prune needs --max-bytes and/or --max-entries, e.g. --max-bytes 20G.")
            removed = bank.prune(args.max_bytes, args.max_entries, dry_run=args.dry_run)
            return {"removed": removed, "dry_run": args.dry_run, **bank.stats()}
        if args.command == "budget":
            return _budget(bank, args)
        if args.command == "merge":
            return _merge(bank, args)
        if args.command == "export":
            return {"exported": bank.export(args.file, tag=args.tag, ids=args.ids), "file": args.file}
        return bank.import_file(args.file)


def _budget(bank, args) -> dict:
    """Without limits: the budget and what counts against it; with them: set, evicting what no longer fits."""
    limits = args.max_bytes is not None or args.max_entries is not None
    if args.unlimited and limits:
        raise BankError("budget: --unlimited removes the budget; give it without --max-bytes and --max-entries.")
    if not (limits or args.unlimited):
        return bank.budget_status()
    eviction = bank.set_budget(args.max_bytes, args.max_entries)
    return {**bank.budget_status(), "evicted": len(eviction.entry_ids), "bytes_freed": eviction.bytes_freed}


def _merge(bank, args) -> dict:
    """Without thresholds: the policy and what merging keeps; with both (or --off): set it."""
    given = args.similarity is not None or args.agreement is not None
    if args.off and given:
        raise BankError("merge: --off turns merging off; give it without --similarity and --agreement.")
    if given and (args.similarity is None or args.agreement is None):
        raise BankError("merge needs both --similarity and --agreement (e.g. 0.65 and 0.55), or --off.")
    if given or args.off:
        bank.set_merge_policy(args.similarity, args.agreement)
    return bank.merge_status()


def _replay_spool(bank) -> dict:
    """Recordings a stopped ComfyUI left spooled go in first (each once, whoever else replays)."""
    outcome = spool.replay_spool(bank)
    for kind, ids in outcome.items():
        if ids:
            print(f"spool: {len(ids)} {kind}: {', '.join(ids)}", file=sys.stderr)
    return outcome


def _print_human(result) -> None:
    rows = result if isinstance(result, list) else [result]
    for row in rows:
        if isinstance(result, list):
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["created"] or 0))
            tags = row["tags"] if isinstance(row["tags"], list) else [str(row["tags"])]
            print(f"{row['id']}  {when}  hits={row['hits']:<4} {row['status']:<11} "
                  f"density={row['density'] or 0:.3f} tags={','.join(tags)}")
        else:
            for key, value in row.items():
                print(f"{key}: {value}")


def _exit_code(command: str, result) -> int:
    if command != "verify":
        return 0
    if result["problems"]:
        for problem in result["problems"]:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    repaired = result["quarantined"] or result["orphans_removed"] or result["spool"]["quarantined"]
    return 1 if repaired else 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = _run(args)
    except BankError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug: still no traceback, and say where to report it
        print(f"error: {type(exc).__name__}: {exc}. This is a Chorus bug; please report it with "
              "the command line you ran.", file=sys.stderr)
        return 2
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        _print_human(result)
    return _exit_code(args.command, result)


if __name__ == "__main__":
    sys.exit(main())
