"""Command line: ``python -m chorus_core.bank {init,stats,list,show,verify,prune,export,import} PATH``."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .errors import BankError
from .store import MaskBank


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m chorus_core.bank", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def cmd(name, help_):
        c = sub.add_parser(name, help=help_)
        c.add_argument("path", help="bank folder (holds bank.sqlite and blobs/)")
        c.add_argument("--json", action="store_true", help="print JSON")
        return c

    cmd("init", "create an empty bank (or migrate an old one)")
    cmd("stats", "entries, bytes, hits, schema version")
    c = cmd("list", "entries, newest first")
    c.add_argument("--tag")
    c.add_argument("--limit", type=int, default=50)
    cmd("show", "one entry").add_argument("entry_id")
    cmd("verify", "recompute every blob digest; quarantine failures")
    c = cmd("prune", "evict least recently used entries until the limits hold")
    c.add_argument("--max-bytes", type=_size)
    c.add_argument("--max-entries", type=int)
    c.add_argument("--dry-run", action="store_true")
    c = cmd("export", "write entries and blobs to one tar file")
    c.add_argument("file")
    c.add_argument("--tag")
    c.add_argument("--id", action="append", dest="ids")
    cmd("import", "add the entries of an export file").add_argument("file")
    return p


def _size(text: str) -> int:
    """``500M``, ``20G``, ``1048576`` -> bytes."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    text = text.strip().upper().removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def _run(args) -> object:
    read_only = args.command in ("stats", "list", "show", "export")
    with MaskBank.open(args.path, read_only=read_only, create=args.command == "init") as bank:
        if args.command == "init":
            return bank.stats()
        if args.command == "stats":
            return bank.stats()
        if args.command == "list":
            return bank.entries(tag=args.tag, limit=args.limit)
        if args.command == "show":
            return bank.show(args.entry_id)
        if args.command == "verify":
            return bank.verify()
        if args.command == "prune":
            if args.max_bytes is None and args.max_entries is None:
                raise BankError("prune needs --max-bytes and/or --max-entries, e.g. --max-bytes 20G.")
            removed = bank.prune(args.max_bytes, args.max_entries, dry_run=args.dry_run)
            return {"removed": removed, "dry_run": args.dry_run, **bank.stats()}
        if args.command == "export":
            return {"exported": bank.export(args.file, tag=args.tag, ids=args.ids), "file": args.file}
        return bank.import_file(args.file)


def _print_human(result) -> None:
    rows = result if isinstance(result, list) else [result]
    for row in rows:
        if isinstance(result, list):
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["created"]))
            print(f"{row['id']}  {when}  hits={row['hits']:<4} {row['status']:<11} "
                  f"density={row['density']:.3f} tags={','.join(row['tags'])}")
        else:
            for key, value in row.items():
                print(f"{key}: {value}")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        result = _run(args)
    except BankError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        _print_human(result)
    return 1 if args.command == "verify" and result["quarantined"] else 0


if __name__ == "__main__":
    sys.exit(main())
