"""`rankwatch bench decode` runs on a small batch and reports every encoding's figures."""

from __future__ import annotations

import json

import pytest

from bench import decode


def test_decode_bench_reports_each_encoding(capsys: pytest.CaptureFixture[str]) -> None:
    assert decode.main(["--rows", "200", "--rounds", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["encodings"]) == set(decode.ENCODINGS)
    for r in out["encodings"].values():
        assert r["decode_ns_per_record"] > 0 and r["zstd_bytes_per_record"] > 0
    # the framed batch carries no base64: fewer bytes than packed JSON before compression
    enc = out["encodings"]
    assert enc["binary"]["bytes_per_record"] < enc["json-packed"]["bytes_per_record"]


def test_decode_bench_refuses_an_empty_batch() -> None:
    with pytest.raises(SystemExit):
        decode.main(["--rows", "0"])
