"""Pure logic of streams.db: migration files, ClickHouse URLs, and the SQL text checks the
endpoint makes. No ClickHouse here (tests/integration/test_clickhouse.py applies migrations)."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

import pytest

from streams.db import (
    ClickHouseError,
    Database,
    MigrationError,
    Target,
    client_args,
    load_migrations,
    migrations_dir,
    parse_url,
    refusal,
    split_statements,
    wants_format,
)

# ---------------------------------------------------------------------------------------------
# Migration files


def test_split_statements_on_semicolons_at_line_ends() -> None:
    text = ("-- header comment\n"
            "CREATE TABLE a (x String DEFAULT ';') ENGINE = Memory;\n"
            "\n"
            "-- between\n"
            "CREATE TABLE b\n(\n    y Int8\n) ENGINE = Memory;   \n"  # trailing blanks
            "SELECT 1; SELECT 2\n"
            "-- only a comment;\n")
    assert split_statements(text) == [
        "-- header comment\nCREATE TABLE a (x String DEFAULT ';') ENGINE = Memory",
        "-- between\nCREATE TABLE b\n(\n    y Int8\n) ENGINE = Memory",
        "SELECT 1; SELECT 2\n-- only a comment",
    ]


def test_split_statements_drops_comment_only_pieces() -> None:
    assert split_statements("-- nothing;\n\n/* nor here */;\n") == []
    assert split_statements("SELECT 1") == ["SELECT 1"]


def _write(d: Path, name: str, text: str) -> Path:
    p = d / name
    p.write_text(text)
    return p


def test_load_orders_by_version_and_checksums_bytes(tmp_path: Path) -> None:
    _write(tmp_path, "010_later.sql", "SELECT 10;\n")
    p = _write(tmp_path, "002_second.sql", "SELECT 2;\nSELECT 3;\n")
    _write(tmp_path, "001_first.sql", "SELECT 1;\n")
    _write(tmp_path, "examples.sql", "not a migration")
    _write(tmp_path, "README.md", "# docs")
    migs = load_migrations(tmp_path)
    assert [(m.version, m.name) for m in migs] == [(1, "001_first"), (2, "002_second"),
                                                   (10, "010_later")]
    assert migs[1].statements == ("SELECT 2", "SELECT 3")
    assert migs[1].checksum == hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", ["1_short.sql", "001-dash.sql", "001_Upper.sql", "001_.sql"])
def test_load_rejects_misnamed_migrations(tmp_path: Path, name: str) -> None:
    _write(tmp_path, name, "SELECT 1;\n")
    with pytest.raises(MigrationError, match="NNN_lower_case_name"):
        load_migrations(tmp_path)


def test_load_rejects_duplicate_versions_and_empty_files(tmp_path: Path) -> None:
    _write(tmp_path, "001_a.sql", "SELECT 1;\n")
    _write(tmp_path, "001_b.sql", "SELECT 1;\n")
    with pytest.raises(MigrationError, match="version 1 is also 001_a"):
        load_migrations(tmp_path)
    (tmp_path / "001_b.sql").unlink()
    _write(tmp_path, "002_empty.sql", "-- nothing yet\n")
    with pytest.raises(MigrationError, match="no statements"):
        load_migrations(tmp_path)


def test_repository_migrations_load_and_are_idempotent_ddl() -> None:
    assert migrations_dir().name == "sql"
    migs = load_migrations()
    assert migs and migs[0].name == "001_raw"
    for mig in migs:
        for statement in mig.statements:
            # ClickHouse DDL is not transactional: a re-run after a failure midway must pass
            assert "IF NOT EXISTS" in statement.upper(), (mig.name, statement[:80])


# ---------------------------------------------------------------------------------------------
# URLs


def test_parse_chdb_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_url(f"chdb://{tmp_path}/ch") == Target("chdb", str(tmp_path / "ch"))
    assert parse_url("chdb://memory") == Target("chdb", ":memory:")
    assert parse_url("chdb://") == Target("chdb", ":memory:")
    monkeypatch.chdir(tmp_path)  # a relative --home gives chdb://rel/clickhouse
    assert parse_url("chdb://rel/clickhouse").path == str(tmp_path / "rel" / "clickhouse")
    with pytest.raises(ValueError, match="no options"):
        parse_url("chdb:///x?a=1")


def test_parse_http_urls() -> None:
    t = parse_url("http://ch.example:9000")
    assert (t.scheme, t.host, t.port, t.username, t.password) == ("http", "ch.example", 9000,
                                                                 "", "")
    assert parse_url("http://ch.example/").port == 8123
    assert parse_url("https://ch.example").port == 8443
    t = parse_url("https://rw%40ops:p%2Fss@ch.example:8443?verify=false")
    assert (t.username, t.password, t.options) == ("rw@ops", "p/ss", (("verify", "false"),))
    assert t.display() == "https://rw@ops@ch.example:8443"
    assert "p/ss" not in repr(t)
    assert not t.embedded and parse_url("chdb:///x").embedded


@pytest.mark.parametrize(("url", "why"), [
    ("http://ch.example:8123/rankwatch", "RANKWATCH_CLICKHOUSE_DATABASE"),
    ("tcp://ch.example:9000", "expected chdb://"),
    ("http://:8123", "no host"),
    ("http://ch.example:99999", "out of range"),
])
def test_parse_rejects(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_url(url)


def test_client_args() -> None:
    chdb = client_args(parse_url("chdb:///data/ch"), {"readonly": 2})
    assert chdb == {"interface": "chdb", "path": "/data/ch",
                    "settings": {"async_insert": 0, "readonly": 2}}
    http = client_args(parse_url("https://u:pw@ch.example?compress=lz4"))
    assert http == {"interface": "https", "host": "ch.example", "port": 8443, "username": "u",
                    "password": "pw", "autogenerate_session_id": False,
                    "settings": {"async_insert": 0}, "compress": "lz4"}
    assert client_args(parse_url("http://ch.example"))["username"] is None


def test_http_url_opens_an_http_client() -> None:
    """No code change between chdb and a server: the same Database takes an http URL and talks
    HTTP to it (here to a closed port, so the error names the address it tried)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(ClickHouseError) as e:
            Database(f"http://rw:secret@127.0.0.1:{port}", "rankwatch")
    assert f"127.0.0.1:{port}" in e.value.message and "secret" not in e.value.message


def test_database_name_is_validated() -> None:
    with pytest.raises(ValueError, match="database 'a-b'"):
        Database("chdb://memory", "a-b")


# ---------------------------------------------------------------------------------------------
# SQL text checks (the endpoint's default format and read-only guard)


@pytest.mark.parametrize(("sql", "expected"), [
    ("SELECT 1", True),
    ("  (SELECT 1) UNION ALL (SELECT 2)", True),
    ("with x as (select 1) select * from x", True),
    ("SHOW TABLES", True),
    ("DESCRIBE ops", True),
    ("SELECT format FROM t", True),  # a column named format is not a FORMAT clause
    ("SELECT 'FORMAT JSON'", True),
    ("SELECT 1 -- FORMAT JSON", True),
    ("SELECT 1 FORMAT JSON", False),
    ("SELECT 1 format CSV;", False),
    ("SELECT 1 FORMAT JSON SETTINGS max_threads = 1", False),
    ("SET max_threads = 1", False),
    ("INSERT INTO t VALUES (1)", False),
    ("CREATE TABLE t (a Int8) ENGINE = Memory", False),
])
def test_wants_format(sql: str, expected: bool) -> None:
    assert wants_format(sql) is expected


@pytest.mark.parametrize(("canonical", "refused"), [
    # canonical texts as ClickHouse's formatQuery writes them (clauses on lines of their own,
    # line breaks in literals escaped)
    ("SELECT 1\nINTO OUTFILE '/tmp/x'", "INTO_OUTFILE_NOT_ALLOWED"),
    ("SELECT 'a\\nINTO OUTFILE b'", None),
    ("INSERT INTO FUNCTION file('/tmp/x', 'CSV') SELECT 1", "READONLY"),
    ("SYSTEM STOP MERGES", "READONLY"),
    ("KILL QUERY WHERE 0 ASYNC", "READONLY"),
    ("USE system", "READONLY"),
    ("SET max_threads = 1", "READONLY"),
    ("SELECT *\nFROM ops", None),
    ("WITH 1 AS a\nSELECT a", None),
    ("SHOW TABLES", None),
    ("DESCRIBE TABLE ops", None),
    ("EXPLAIN\nSELECT 1", None),
    ("EXISTS TABLE ops", None),
])
def test_endpoint_refusal(canonical: str, refused: str | None) -> None:
    why = refusal(canonical, readonly=True)
    assert (why is None) if refused is None else (why is not None and f"({refused})" in why)
    if refused == "READONLY":
        assert refusal(canonical, readonly=False) is None  # a writable endpoint runs them
