"""Bank locations: a folder, or a PostgreSQL URL, and where named PostgreSQL banks come from.

A PostgreSQL bank is named by a URL ``postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE``,
optionally with ``?schema=NAME`` (one bank per PostgreSQL schema; default ``chorus_bank``).
Workers find named banks in, in this order:

* ``CHORUS_BANK_URLS="fleet=postgresql://...;archive=postgresql://..."`` (``;`` or newlines)
* ``chorus_banks:`` in ComfyUI's ``extra_model_paths.yaml``: lines ``NAME=postgresql://...``
  next to (or instead of) folder lines; folder lines stay folders.

The password is best left out of the URL: libpq reads ``PGPASSWORD`` or ``~/.pgpass``. When a
URL does carry one it lives only in this process's memory: every text Chorus shows (errors,
stats, lists, routes, reports, cache keys) uses :func:`redact`, which drops it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from .errors import BankError, BankInvalidArgument

URLS_ENV = "CHORUS_BANK_URLS"
SCHEMES = ("postgresql", "postgres")
DEFAULT_SCHEMA = "chorus_bank"
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_BANK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def is_bank_url(location) -> bool:
    """Whether ``location`` names a PostgreSQL bank rather than a folder."""
    return isinstance(location, str) and location.split(":", 1)[0].lower() in SCHEMES \
        and "://" in location


@dataclass(frozen=True)
class BankURL:
    """A parsed PostgreSQL bank URL; ``conninfo`` holds the password, ``label`` never does."""

    conninfo: str  # what psycopg connects with (may carry the password: never print it)
    schema: str
    host: str
    port: str
    database: str
    user: str
    password: str | None

    @property
    def label(self) -> str:
        """``postgresql://USER@HOST:PORT/DATABASE?schema=NAME``: safe to show anywhere."""
        user = f"{quote(self.user, safe='')}@" if self.user else ""
        port = f":{self.port}" if self.port else ""
        return f"postgresql://{user}{self.host}{port}/{self.database}?schema={self.schema}"

    def scrub(self, text: str) -> str:
        """``text`` with the password (plain or URL-encoded) and the full URL removed."""
        text = text.replace(self.conninfo, self.label)
        if self.password:
            for secret in {self.password, quote(self.password, safe=""), quote(self.password)}:
                text = text.replace(secret, "***")
        return text


def parse(url: str) -> BankURL:
    """Split a bank URL into what psycopg needs and what may be shown.

    :raises BankInvalidArgument: not a postgresql:// URL, or a schema name that is not a plain
        lowercase identifier
    """
    if not is_bank_url(url):
        raise BankInvalidArgument("A PostgreSQL bank URL starts with postgresql://, e.g. "
                                  "postgresql://chorus@db-host:5432/chorus?schema=chorus_bank.")
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schema = next((v for k, v in query if k == "schema"), DEFAULT_SCHEMA)
    rest = [(k, v) for k, v in query if k != "schema"]
    host = parts.hostname or "localhost"
    if not _SCHEMA_NAME.fullmatch(schema):
        raise BankInvalidArgument(f"schema {schema[:70]!r} in the bank URL for {host} must be a "
                                  "lowercase identifier (letters, digits, _), e.g. chorus_bank.")
    conninfo = urlunsplit(("postgresql", parts.netloc, parts.path, urlencode(rest), ""))
    return BankURL(conninfo=conninfo, schema=schema, host=host,
                   port=str(parts.port) if parts.port else "",
                   database=unquote(parts.path.lstrip("/")) or unquote(parts.username or ""),
                   user=unquote(parts.username or ""),
                   password=unquote(parts.password) if parts.password is not None else None)


def redact(location) -> str:
    """A location as it may be shown: a folder as is, a URL without its password."""
    if not is_bank_url(location):
        return str(location)
    try:
        return parse(location).label
    except (BankError, ValueError):
        return "postgresql://(unparseable URL)"


# ---- named banks ------------------------------------------------------------------------
def _from_env(environ) -> dict[str, str]:
    banks = {}
    for item in re.split(r"[;\n]", environ.get(URLS_ENV, "")):
        name, sep, url = item.strip().partition("=")
        if sep and _BANK_NAME.fullmatch(name.strip()) and is_bank_url(url.strip()):
            banks[name.strip()] = url.strip()
    return banks


def _from_yaml(path) -> dict[str, str]:
    """``NAME=URL`` lines under ``chorus_banks`` in any section of an extra_model_paths.yaml.

    ComfyUI reads every value there as newline-separated folders, so a bank URL is written as
    one such line (``chorus_banks: |`` then ``fleet=postgresql://...``); lines that are not
    ``NAME=postgresql://...`` are folders, left to ComfyUI.
    """
    try:
        import yaml

        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh) or {}
    except Exception:  # missing, unreadable or broken: ComfyUI reports its own config errors
        return {}
    banks = {}
    for section in doc.values() if isinstance(doc, dict) else ():
        value = section.get("chorus_banks") if isinstance(section, dict) else None
        banks.update(_from_env({URLS_ENV: value}) if isinstance(value, str) else {})
    return banks


def is_url_line(path: str) -> bool:
    """Whether a registered ``chorus_banks`` path is really a ``NAME=URL`` line (ComfyUI
    registered it as a folder, normalised): never a folder to create or scan."""
    return any(f"={scheme}:" in str(path) for scheme in SCHEMES)


def named_urls(environ=None, yaml_paths=()) -> dict[str, str]:
    """Bank name -> URL, from ``CHORUS_BANK_URLS`` and the given extra_model_paths.yaml files
    (the environment wins on a name clash). Malformed items are ignored."""
    banks = {}
    for path in yaml_paths:
        banks.update(_from_yaml(path))
    banks.update(_from_env(os.environ if environ is None else environ))
    return banks
