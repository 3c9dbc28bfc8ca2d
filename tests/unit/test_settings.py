"""Settings: defaults, environment parsing, precedence, and errors that name the variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from rankwatch.settings import Settings, SettingsError
from rankwatch.stack import settings_env


def test_defaults_are_local_and_loopback():
    s = Settings.load(env={})
    assert s.bind_host == "127.0.0.1"
    assert s.bootstrap == "127.0.0.1:9092"
    assert s.kafka_version.startswith("3.9.")
    assert s.clickhouse == f"chdb://{s.home / 'clickhouse'}"
    assert s.run_dir == s.home / "run"


def test_environment_values_are_parsed_to_their_types():
    s = Settings.load(env={
        "RANKWATCH_HOME": "/srv/rw",
        "RANKWATCH_KAFKA_PORT": "19092",
        "RANKWATCH_SQL_WRITABLE": "true",
        "RANKWATCH_WRITER_MAX_SECONDS": "0.25",
        "RANKWATCH_KAFKA_BOOTSTRAP": "k1:9092,k2:9092",
        "UNRELATED": "x",
    })
    assert s.home == Path("/srv/rw")
    assert s.kafka_port == 19092
    assert s.sql_writable is True
    assert s.writer_max_seconds == 0.25
    assert s.bootstrap == "k1:9092,k2:9092"


def test_overrides_beat_environment_beats_defaults():
    env = {"RANKWATCH_KAFKA_PORT": "19092", "RANKWATCH_SQL_PORT": "18124"}
    s = Settings.load(env=env, kafka_port=29092, sql_port=None)
    assert s.kafka_port == 29092  # override
    assert s.sql_port == 18124  # environment (a None override means "not given")
    assert s.kafka_controller_port == 9093  # default


def test_nothing_is_read_from_the_environment_when_env_is_given(monkeypatch):
    monkeypatch.setenv("RANKWATCH_KAFKA_PORT", "19092")
    assert Settings.load(env={}).kafka_port == 9092
    assert Settings.load().kafka_port == 19092


@pytest.mark.parametrize(("var", "value", "expected"), [
    ("RANKWATCH_KAFKA_PORT", "abc", "integer"),
    ("RANKWATCH_KAFKA_PORT", "70000", "65535"),
    ("RANKWATCH_KAFKA_PARTITIONS", "0", "1"),
    ("RANKWATCH_WRITER_MAX_SECONDS", "0", "0"),
    ("RANKWATCH_CLICKHOUSE_URL", "postgres://x", "chdb://"),
    ("RANKWATCH_SQL_WRITABLE", "maybe", "bool"),
])
def test_errors_name_the_variable_the_value_and_the_rule(var, value, expected):
    with pytest.raises(SettingsError) as e:
        Settings.load(env={var: value})
    msg = str(e.value)
    assert f"{var}={value!r}" in msg
    assert expected in msg


def test_errors_list_every_bad_variable():
    with pytest.raises(SettingsError) as e:
        Settings.load(env={"RANKWATCH_KAFKA_PORT": "x", "RANKWATCH_SQL_PORT": "0"})
    assert "RANKWATCH_KAFKA_PORT" in str(e.value)
    assert "RANKWATCH_SQL_PORT" in str(e.value)


def test_an_override_error_names_the_option_not_a_variable():
    with pytest.raises(SettingsError) as e:
        Settings.load(env={}, kafka_port=0)
    assert "--kafka-port=0" in str(e.value)
    assert "RANKWATCH_" not in str(e.value)


def test_a_misspelled_variable_is_reported_not_silently_ignored():
    with pytest.warns(UserWarning, match="RANKWATCH_KAFKA_PROT is not a setting; did you mean "
                      "RANKWATCH_KAFKA_PORT"):
        Settings.load(env={"RANKWATCH_KAFKA_PROT": "1"})


def test_other_rankwatch_variables_are_not_mistaken_for_typos():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Settings.load(env={"RANKWATCH_JOB_ID": "j", "RANKWATCH_TRACE": "1",
                           "RANKWATCH_NCCL_KERNEL_CH_WAIT": "0"})


def test_unknown_override_is_rejected():
    with pytest.raises(SettingsError, match="bogus"):
        Settings.load(env={}, bogus=1)


def test_settings_are_frozen():
    s = Settings.load(env={})
    with pytest.raises(ValidationError):
        s.kafka_port = 1


def test_settings_env_round_trips_every_field():
    """What `rankwatch up` hands its worker: the child must see exactly the parent's settings."""
    s = Settings.load(env={}, home="/tmp/h", kafka_port=19092, sql_writable=True,
                      writer_max_seconds=0.5, topic_prefix="dev", kafka_bootstrap="",
                      clickhouse_url="http://ch:8123")
    env = settings_env(s)
    assert set(env) == {f"RANKWATCH_{n.upper()}" for n in Settings.model_fields}
    assert Settings.load(env=env) == s
