"""The ClickHouse server profile and user docs/architecture.md gives for the SQL endpoint: the
SQL parses with the engine's own parser, the users.xml is well formed, and both cap exactly
the limits the worker sends by default (a MAX below them would refuse every query). No server
runs here: this checks the text, not a server's behaviour."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from rankwatch.commands.worker import sql_limits
from rankwatch.settings import Settings
from streams.db import Database, endpoint_target, parse_url, split_statements

DOC = Path(__file__).parents[2] / "docs" / "architecture.md"


def blocks(lang: str) -> list[str]:
    text = DOC.read_text()
    section = text[text.index("**On a ClickHouse server.**"):]
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def sent_limits() -> dict[str, str]:
    """What the endpoint sends with each query on a server, by the default settings."""
    limits = sql_limits(Settings.load(env={})).settings(embedded=False)
    return {k: str(v) for k, v in limits.items()}


def test_the_documented_sql_parses_and_caps_the_limits_sent(clickhouse_db: Database) -> None:
    (sql,) = blocks("sql")
    statements = split_statements(sql)
    assert [s.split()[0] for s in statements] == ["CREATE", "CREATE", "REVOKE", "GRANT"]
    for s in statements:
        canonical = clickhouse_db.query("SELECT formatQuery({q:String})", {"q": s}).result_rows
        assert canonical and canonical[0][0].split()[0] == s.split()[0]
    profile = statements[0]
    for name, value in sent_limits().items():
        m = re.search(rf"\b{name} = ('?\w+'?) (MAX (\d+)|CONST)", profile)
        assert m, f"the profile does not constrain {name}"
        assert m.group(1).strip("'") == value, name
        assert m.group(2) == "CONST" or int(m.group(3)) >= int(value), name
    assert statements[-1] == "GRANT SELECT ON rankwatch.* TO rankwatch_sql"


def test_the_documented_users_xml_matches() -> None:
    (xml,) = blocks("xml")
    root = ET.fromstring(xml)
    profile = root.find("profiles/rankwatch_sql")
    assert profile is not None
    for name, value in sent_limits().items():
        assert profile.findtext(name) == value, name
        c = profile.find(f"constraints/{name}")
        assert c is not None and (c.find("const") is not None
                                  or int(c.findtext("max") or 0) >= int(value)), name
    user = root.find("users/rankwatch_sql")
    assert user is not None and user.findtext("profile") == "rankwatch_sql"
    assert user.findtext("grants/query") == "GRANT SELECT ON rankwatch.*"


def test_the_endpoint_runs_as_its_own_user_on_a_server_only() -> None:
    server = parse_url("http://writer:w@ch:8123")
    t = endpoint_target(server, "rankwatch_sql", "p")
    assert (t.host, t.port, t.username, t.password) == ("ch", 8123, "rankwatch_sql", "p")
    assert endpoint_target(server, "", "") == server  # none configured: the writer's user
    embedded = parse_url("chdb:///tmp/x")
    assert endpoint_target(embedded, "rankwatch_sql", "p") == embedded
