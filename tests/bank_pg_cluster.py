"""A throwaway PostgreSQL cluster for the bank tests and benchmark: Debian's server binaries,
a data folder under a temporary directory, loopback only, stopped and removed at the end.

As root (CI, a fresh clone) the server runs as the ``postgres`` user that Debian's package
creates (PostgreSQL refuses to run as root). Tests connect as role ``chorus`` with a password
over TCP (scram-sha-256), so error texts can be checked for the password.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid

import pytest

USER, PASSWORD, DATABASE = "chorus", "S3cret-chorus-pw", "chorus_test"
REQUIRE_ENV = "CHORUS_REQUIRE_POSTGRES"  # set by `make test`: a missing server fails, not skips


def server_bin() -> str | None:
    """Folder of the newest installed PostgreSQL server binaries (initdb, pg_ctl)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return os.path.dirname(found[-1]) if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """``start()``, ``url(schema)``, ``restart()``, ``stop()``, ``kill()`` / ``start_again()``."""

    def __init__(self):
        self.bin = server_bin()
        if self.bin is None:
            raise RuntimeError("PostgreSQL server binaries not found (apt-get install postgresql)")
        self.dir = tempfile.mkdtemp(prefix="chorus-pg-")
        self.data, self.port = os.path.join(self.dir, "data"), free_port()
        self.as_server = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_server:
            shutil.chown(self.dir, "postgres", "postgres")

    def _run(self, *argv, check=True, timeout=120) -> subprocess.CompletedProcess:
        return subprocess.run([*self.as_server, *argv], capture_output=True, text=True,
                              check=check, timeout=timeout, cwd=self.dir)

    def start(self) -> "Cluster":
        pwfile = os.path.join(self.dir, "pw")
        with open(pwfile, "w") as fh:
            fh.write("unused-superuser-pw\n")
        if self.as_server:
            shutil.chown(pwfile, "postgres", "postgres")
        self._run(f"{self.bin}/initdb", "-D", self.data, "-U", "postgres", "-E", "UTF8",
                  "--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}")
        self.start_again()
        self.sql(f"CREATE ROLE {USER} LOGIN PASSWORD '{PASSWORD}'")
        self.sql(f"CREATE DATABASE {DATABASE} OWNER {USER}")
        return self

    def start_again(self) -> None:
        options = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200 "
                   "-c shared_buffers=256MB")
        self._run(f"{self.bin}/pg_ctl", "-D", self.data, "-o", options, "-w",
                  "-l", os.path.join(self.dir, "server.log"), "start")

    def sql(self, statement: str, database: str = "postgres") -> str:
        return self._run(f"{self.bin}/psql", "-h", self.dir, "-p", str(self.port), "-U",
                         "postgres", "-d", database, "-v", "ON_ERROR_STOP=1", "-tAc",
                         statement).stdout

    def url(self, schema: str | None = None, password: bool = True) -> str:
        auth = f"{USER}:{PASSWORD}" if password else USER
        base = f"postgresql://{auth}@127.0.0.1:{self.port}/{DATABASE}"
        return f"{base}?schema={schema}" if schema else base

    @staticmethod
    def fresh_schema() -> str:
        return f"t_{uuid.uuid4().hex[:16]}"

    def restart(self) -> None:
        # -l as at start: without it the server would write to (and hold open) our stdout pipe
        self._run(f"{self.bin}/pg_ctl", "-D", self.data, "-m", "fast", "-w",
                  "-l", os.path.join(self.dir, "server.log"), "restart")

    def stop(self, mode: str = "fast") -> None:
        self._run(f"{self.bin}/pg_ctl", "-D", self.data, "-m", mode, "-w", "stop", check=False)

    def remove(self) -> None:
        self.stop("immediate")
        for _ in range(20):  # the postmaster may take a moment to let go of its files
            shutil.rmtree(self.dir, ignore_errors=True)
            if not os.path.exists(self.dir):
                return
            time.sleep(0.1)


def running_cluster():
    """A module fixture's body: a started throwaway cluster, removed afterwards.

    Without PostgreSQL's server binaries the tests skip, or fail when ``CHORUS_REQUIRE_POSTGRES=1``
    (``make test`` sets it, so CI never skips them silently).
    """
    if server_bin() is None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail("PostgreSQL server binaries are missing: apt-get install postgresql")
        pytest.skip("PostgreSQL server binaries not installed (apt-get install postgresql)")
    cluster = Cluster().start()
    try:
        yield cluster
    finally:
        cluster.remove()


@pytest.fixture(scope="module")
def pg():
    """A throwaway cluster for one test module (import it there with ``location``)."""
    yield from running_cluster()


@pytest.fixture(params=["folder", "postgres"])
def location(request, tmp_path):
    """Where a fresh bank lives: a folder, or a new schema of the test server."""
    if request.param == "folder":
        return str(tmp_path / "bank")
    cluster = request.getfixturevalue("pg")
    return cluster.url(cluster.fresh_schema())


@pytest.fixture
def bank(location):
    """A fresh bank at ``location``, open for the test and closed after it."""
    from chorus_core.bank import MaskBank

    with MaskBank.open(location) as opened:
        yield opened
