"""The notify configuration file (TOML) and routing — pure.

```toml
group_id = "rankwatch-notify"     # the Kafka consumer group (its own: never `tail`'s)
max_attempts = 30                 # failures before a version is dead-lettered for a sink
backoff_s = 0.5                   # first retry delay; doubles up to backoff_max_s, with jitter
backoff_max_s = 30.0
resend_s = 60.0                   # Alertmanager: active alerts are re-sent this often
max_age_s = 86400.0               # versions detected longer ago than this are not sent
page_url = "http://127.0.0.1:8124/incidents/{incident_id}"   # link in every message

[sinks.am]
type = "alertmanager"
url = "http://127.0.0.1:9093"

[sinks.pd]
type = "pagerduty"
routing_key_env = "PAGERDUTY_ROUTING_KEY"   # or routing_key = "…"

[sinks.chat]
type = "slack"
url_env = "SLACK_WEBHOOK_URL"
min_interval_s = 1.0              # Slack takes about one message a second per webhook

[sinks.hook]
type = "webhook"
url = "https://ops.example.com/rankwatch"
secret_env = "RANKWATCH_WEBHOOK_SECRET"

[[routes]]
jobs = ["prod-*"]                 # fnmatch globs on job_id
kinds = ["hang", "slowdown"]      # default: every kind
status = ["open", "updated", "resolved"]
min_confidence = 0.5
sinks = ["am", "pd", "chat"]
```

Every route a version matches adds its sinks (each sink once). Secrets and URLs may come from
environment variables named by `*_env`, so the file itself can be committed. Errors name the
key, the value and what was expected.
"""

from __future__ import annotations

import fnmatch
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from diagnosis.model import Diagnosis, Status
from diagnosis.rules.base import Kind

SinkType = Literal["alertmanager", "pagerduty", "slack", "webhook"]
PAGERDUTY_URL = "https://events.pagerduty.com/v2/enqueue"


class NotifyConfigError(ValueError):
    """A bad notify configuration; the message says which key and why."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SinkConfig(_Model):
    type: SinkType
    url: str = ""
    url_env: str = ""
    #: webhook: the HMAC-SHA256 key
    secret: str = ""
    secret_env: str = ""
    #: pagerduty: the integration's routing key
    routing_key: str = ""
    routing_key_env: str = ""
    #: at least this long between two requests to this sink (Slack: 1 s)
    min_interval_s: Annotated[float, Field(ge=0, le=3600)] = 0.0
    timeout_s: Annotated[float, Field(gt=0, le=120)] = 10.0
    #: overrides the file's max_attempts for this sink
    max_attempts: Annotated[int, Field(ge=1, le=10_000)] | None = None


class Route(_Model):
    jobs: list[str] = Field(default_factory=lambda: ["*"])
    kinds: list[Kind] | None = None
    status: list[Status] | None = None
    min_confidence: Annotated[float, Field(ge=0, le=1)] = 0.0
    sinks: list[str] = Field(min_length=1)

    def matches(self, d: Diagnosis) -> bool:
        return (any(fnmatch.fnmatchcase(d.job_id, g) for g in self.jobs)
                and (self.kinds is None or d.kind in self.kinds)
                and (self.status is None or d.status in self.status)
                and d.confidence >= self.min_confidence)


class NotifyConfig(_Model):
    group_id: str = "rankwatch-notify"
    max_attempts: Annotated[int, Field(ge=1, le=10_000)] = 30
    backoff_s: Annotated[float, Field(gt=0, le=600)] = 0.5
    backoff_max_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    resend_s: Annotated[float, Field(gt=0, le=3600)] = 60.0
    #: a version detected longer ago than this is skipped: a new consumer group starts at the
    #: topic's beginning (nothing published while it joins is missed), and a year of history
    #: must not page anyone
    max_age_s: Annotated[float, Field(gt=0)] = 86400.0
    page_url: str = ""
    #: where the delivery ledger lives; default <home>/notify/ledger.sqlite
    state_file: str = ""
    #: versions received but not yet delivered everywhere; polling pauses above this
    max_pending: Annotated[int, Field(ge=1, le=1_000_000)] = 10_000
    sinks: dict[str, SinkConfig]
    routes: list[Route] = Field(min_length=1)

    @field_validator("sinks")
    @classmethod
    def _some_sink(cls, v: dict[str, SinkConfig]) -> dict[str, SinkConfig]:
        if not v:
            raise ValueError("at least one [sinks.NAME] table is needed")
        return v

    @model_validator(mode="after")
    def _routes_name_sinks(self) -> NotifyConfig:
        for i, r in enumerate(self.routes):
            unknown = [s for s in r.sinks if s not in self.sinks]
            if unknown:
                raise ValueError(f"routes[{i}].sinks names {unknown}, not among the sinks "
                                 f"{sorted(self.sinks)}")
        return self

    def route(self, d: Diagnosis) -> list[str]:
        """The sinks version `d` goes to, in the order the routes name them."""
        out: list[str] = []
        for r in self.routes:
            if r.matches(d):
                out += [s for s in r.sinks if s not in out]
        return out

    def max_attempts_of(self, sink: str) -> int:
        return self.sinks[sink].max_attempts or self.max_attempts


def _resolve(name: str, s: SinkConfig, env: Mapping[str, str]) -> SinkConfig:
    """Fill url/secret/routing_key from the environment variables the file names; check what
    each sink type needs."""
    values = s.model_dump()
    for key in ("url", "secret", "routing_key"):
        var = values[f"{key}_env"]
        if var:
            if var not in env:
                raise NotifyConfigError(f"sinks.{name}.{key}_env: the environment variable "
                                        f"{var} is not set")
            values[key] = env[var]
    if s.type == "pagerduty" and not values["url"]:
        values["url"] = PAGERDUTY_URL
    url = values["url"]
    if not url.startswith(("http://", "https://")):
        raise NotifyConfigError(f"sinks.{name}.url: {url!r} is not an http(s) URL")
    if s.type == "pagerduty" and not values["routing_key"]:
        raise NotifyConfigError(f"sinks.{name}: a pagerduty sink needs routing_key or "
                                "routing_key_env")
    if s.type == "webhook" and not values["secret"]:
        raise NotifyConfigError(f"sinks.{name}: a webhook sink needs secret or secret_env "
                                "(its requests are signed with HMAC-SHA256)")
    return SinkConfig.model_validate(values)


def parse(data: Mapping[str, Any], env: Mapping[str, str], where: str = "config") -> NotifyConfig:
    try:
        cfg = NotifyConfig.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"{loc}: {err['msg']}" + (f" (got {err['input']!r})"
                                                    if err["type"] != "missing" else ""))
        raise NotifyConfigError(f"{where}:\n  " + "\n  ".join(lines)) from None
    sinks = {n: _resolve(n, s, env) for n, s in cfg.sinks.items()}
    return cfg.model_copy(update={"sinks": sinks})


def load(path: Path, env: Mapping[str, str]) -> NotifyConfig:
    """Read and check the TOML file at `path`."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise NotifyConfigError(f"{path}: cannot read it: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise NotifyConfigError(f"{path}: not valid TOML: {e}") from None
    return parse(data, env, str(path))
