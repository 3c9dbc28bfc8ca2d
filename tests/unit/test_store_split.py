"""streams.store_server.split_request: where a request's statement ends and its data starts,
as ClickHouse's HTTP server reads them."""

from __future__ import annotations

from streams.store_server import split_request


def test_statement_in_the_body_then_the_data() -> None:
    body = b"INSERT INTO `db`.`ops` (`a`, `b`) FORMAT Native\n\x00\x01\nbinary"
    assert split_request("", body) == ("INSERT INTO `db`.`ops` (`a`, `b`)",
                                       b"\x00\x01\nbinary", "Native")


def test_statement_in_the_url_and_the_body_is_the_data() -> None:
    assert split_request("insert into t format JSONEachRow", b'{"a": 1}\n') == (
        "insert into t", b'{"a": 1}\n', "JSONEachRow")


def test_a_query_is_not_data() -> None:
    assert split_request("", b"SELECT 1\nFORMAT Native") == ("SELECT 1\nFORMAT Native", None,
                                                            None)
    assert split_request("SELECT {x:Int32}", b"") == ("SELECT {x:Int32}", None, None)
    # an INSERT ... SELECT carries no data
    assert split_request("", b"INSERT INTO t SELECT 1") == ("INSERT INTO t SELECT 1", None, None)
