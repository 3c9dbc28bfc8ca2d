"""The one communicator-kind decision (ingest.records): numpy, the ClickHouse SQL generated from
the same table (the derived streams' and the operator's query), the diagnosis grid's accessor the
rules read it through, and how it relates to the rules it replaced."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import orjson
import pytest

from diagnosis.conclusion import Conclusion
from diagnosis.engine import declared_codes_sql, operator_sql
from diagnosis.groups import Grid
from ingest.records import (
    COMM_KIND_CODES,
    COMM_KIND_OTHER,
    COMM_KINDS,
    comm_kind,
    comm_kind_by_name,
    comm_kind_code_sql,
    comm_kind_codes,
    comm_kinds,
    declared_codes,
)

HEADS = ("tp", "pp", "dp", "ep", "cp", "world", "dpx", "tp1", "ppc", "pg", "", "x", "DP", "dp ")
SEPS = (":", "", "_", "::", "-")
TAILS = ("", "0", "pp0:tp1", "inferred:2", "dp", "ö'")
IDS = sorted({h + s + t for h, s, t in itertools.product(HEADS, SEPS, TAILS)}
             | {"world", "dp:world", ":dp", "0x1f2e", "pg0", "tp'1", "dp:pp0:tp0", "pp:dp1:tp0"})
#: the topology: kinds that agree with the name, disagree with it, or name no kind at all
DECLARED = {"dp:pp0:tp0": "dp", "pp:dp1:tp0": "pp", "dp:odd": "tp", "pg0": "pp", "ep:1": "dp",
            "x": "world", "tp1": "tp", "dp0": "ep", "0x1f2e": "dp"}
IDS = sorted(set(IDS) | set(DECLARED))


def old_numpy_code(comm_id: str, declared: dict[str, str]) -> int:
    """streams.iterations.comm_kind_codes as it was: the topology, else the part before ':'."""
    return {"tp": 0, "pp": 1, "dp": 2}.get(declared.get(comm_id, comm_id.split(":", 1)[0]), 3)


def old_sql_code(comm_id: str, declared: dict[str, str]) -> int:
    """streams.derived.COMM_KIND_SQL as it was: the topology, else startsWith tp/pp/dp."""
    if comm_id in declared:
        return {"tp": 0, "pp": 1, "dp": 2}.get(declared[comm_id], 3)
    return next((c for p, c in (("tp", 0), ("pp", 1), ("dp", 2)) if comm_id.startswith(p)), 3)


def old_diagnosis_kind(comm_id: str, declared: dict[str, str]) -> str:
    """diagnosis (window.comm_kind_of_ops, slow Ctx.comm_kinds) as it was: the topology only."""
    return declared.get(comm_id, "")


def test_the_table() -> None:
    assert set(COMM_KIND_CODES) <= set(COMM_KINDS)
    assert COMM_KIND_OTHER not in COMM_KIND_CODES.values()
    assert comm_kind("dp:pp0:tp1", {}) == "dp"
    assert comm_kind("pp:inferred:0", {}) == "pp"
    assert comm_kind("dp0", {}) == ""  # a name merely beginning with the letters says nothing
    assert comm_kind("dp0", {"dp0": "dp"}) == "dp"  # the topology decides first
    assert comm_kind("dp:x", {"dp:x": "tp"}) == "tp"
    assert comm_kind("pg3", {}) == ""


def test_codes_equal_the_previous_numpy_rule_everywhere() -> None:
    got = comm_kind_codes(np.array(IDS, dtype=object), DECLARED)
    assert got.dtype == np.int8
    assert got.tolist() == [old_numpy_code(c, DECLARED) for c in IDS]
    # many rows, few distinct ids: one decision per id, broadcast back
    rows = np.array(IDS * 3, dtype=object)[np.random.default_rng(1).permutation(3 * len(IDS))]
    assert comm_kind_codes(rows, DECLARED).tolist() == [old_numpy_code(c, DECLARED) for c in rows]
    assert comm_kind_codes(np.array([], dtype=object), {}).tolist() == []


def test_where_the_previous_sql_rule_differs() -> None:
    """Only for an id the topology does not declare whose name starts with tp/pp/dp without
    being `<kind>:...` (`dp0`, `ppc`, `tp_x`): the SQL called it that kind, now it is other."""
    new = comm_kind_codes(np.array(IDS, dtype=object), DECLARED).tolist()
    differ = {c for c, n in zip(IDS, new, strict=True) if n != old_sql_code(c, DECLARED)}
    expected = {c for c in IDS if c not in DECLARED and c[:2] in ("tp", "pp", "dp")
                and c.split(":", 1)[0] not in ("tp", "pp", "dp")}
    assert differ == expected and "ppc" in differ and "dp0" not in differ  # dp0 is declared


def test_where_the_previous_diagnosis_rule_differs() -> None:
    """Only for an id the topology does not declare whose name is `<kind>:...`: diagnosis called
    it unknown, now it has the kind its name gives (as the derived streams always did)."""
    new = comm_kinds(IDS, DECLARED).tolist()
    differ = {c for c, n in zip(IDS, new, strict=True) if n != old_diagnosis_kind(c, DECLARED)}
    expected = {c for c in IDS if c not in DECLARED and comm_kind_by_name(c)}
    assert differ == expected and "dp:world" in differ
    assert all(comm_kinds(IDS, DECLARED)[i] == DECLARED[c] for i, c in enumerate(IDS)
               if c in DECLARED)


def _sql_str(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


Query = Callable[[str], list[list[object]]]


@pytest.fixture(scope="module")
def chdb_query() -> Query:
    chdb = pytest.importorskip("chdb")  # embedded ClickHouse, in this process

    def query(sql: str) -> list[list[object]]:
        out = orjson.loads(chdb.query(sql, "JSONCompact").bytes())
        return [list(r) for r in out["data"]]
    return query


@pytest.mark.parametrize("declared", [DECLARED, {}], ids=["topology", "no-topology"])
def test_sql_expression_decides_as_numpy(chdb_query: Query, declared: dict[str, str]) -> None:
    ids, codes = declared_codes(declared.items())
    expr = comm_kind_code_sql(
        "comm_id", ids=f"CAST([{', '.join(map(_sql_str, ids))}] AS Array(String))",
        codes=f"CAST([{', '.join(map(str, codes))}] AS Array(Int8))")
    values = ", ".join(_sql_str(c) for c in IDS)
    # the operator's query reads the topology from the jobs table (here: a row like its rows;
    # without a topology, no row for the job at all)
    source = (f"(SELECT 'j' AS job_id, CAST([{', '.join(map(_sql_str, declared))}] AS "
              f"Array(String)) AS comm_ids, CAST([{', '.join(map(_sql_str, declared.values()))}]"
              " AS Array(LowCardinality(String))) AS comm_kinds)")
    job = "'j'" if declared else "'another job'"
    operator = comm_kind_code_sql("comm_id", *declared_codes_sql(job, source))
    rows = chdb_query(f"SELECT comm_id, {expr} AS kind, toTypeName(kind) AS t, "
                      f"{operator} = {COMM_KIND_CODES['dp']} AS operator_dp FROM (SELECT "
                      f"toLowCardinality(arrayJoin([{values}])) AS comm_id) ORDER BY comm_id")
    got = {str(r[0]): (int(str(r[1])), str(r[2]), bool(r[3])) for r in rows}
    assert set(got) == set(IDS)
    want = dict(zip(IDS, comm_kind_codes(np.array(IDS, dtype=object), declared).tolist(),
                    strict=True))
    assert {c: k for c, (k, _, _) in got.items()} == want
    assert {t for _, t, _ in got.values()} == {"Int8"}
    # the operator's query (diagnosis.engine.operator_sql) picks the same dp communicators
    assert {c for c, (_, _, dp) in got.items() if dp} == {c for c, k in want.items()
                                                         if k == COMM_KIND_CODES["dp"]}


def test_the_operators_dp_query_uses_the_decision() -> None:
    c = Conclusion(kind="slowdown", ranks=(3,), stage="dp_allreduce", component=None,
                   confidence=0.5)
    dp_query = operator_sql("job-1", c, 10**18)[-1]
    expr = comm_kind_code_sql("comm_id", *declared_codes_sql("'job-1'"))
    assert f"{expr} = {COMM_KIND_CODES['dp']}" in dp_query and "FROM jobs FINAL" in expr


def test_the_rules_read_kinds_through_the_grid() -> None:
    """diagnosis rules ask the grid (`Grid.kind_of`), which asks ingest.records: on a declared
    communicator the topology's kind, as the rules' own lookups gave."""
    one = np.zeros(1, np.int64)
    grid = Grid(tp=1, pp=1, dp=1, stage=one, dp_index=one, tp_index=one, hosts=("h",),
                comm_kind=dict(DECLARED), comm_members={})
    assert [grid.kind_of(c) for c in IDS] == [comm_kind(c, DECLARED) for c in IDS]
    assert grid.kinds_of(IDS).tolist() == comm_kinds(IDS, DECLARED).tolist()
    assert all(grid.kind_of(c) == k for c, k in DECLARED.items())
