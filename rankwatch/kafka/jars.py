"""The Kafka broker's jars: fetched from Maven Central once, through `mvn`, into the cache dir.

The jars of `settings.kafka_version` land in ``<cache>/kafka-<version>/lib``; a marker file
records a complete fetch, so later calls return at once and a failed one is redone.
"""

from __future__ import annotations

import contextlib
import fcntl
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from rankwatch.daemon import Progress
from rankwatch.kafka import BrokerError
from rankwatch.settings import Settings

#: What `ensure_jars` asks Maven for; the slf4j binding makes the broker log through log4j 1.
SLF4J_BINDING = ("org.slf4j", "slf4j-reload4j", "1.7.36")
JARS_MARKER = ".complete"


def _pom(version: str) -> str:
    deps = [("org.apache.kafka", "kafka_2.13", version), SLF4J_BINDING]
    body = "\n".join(
        f"    <dependency><groupId>{g}</groupId><artifactId>{a}</artifactId>"
        f"<version>{v}</version></dependency>"
        for g, a, v in deps
    )
    return f"""<project xmlns="http://maven.apache.org/POM/4.0.0">
  <!-- Written by rankwatch: the jars of an Apache Kafka {version} broker. -->
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.rankwatch</groupId>
  <artifactId>kafka-broker-jars</artifactId>
  <version>{version}</version>
  <packaging>pom</packaging>
  <dependencies>
{body}
  </dependencies>
</project>
"""


def jars_dir(settings: Settings) -> Path:
    """Where the jars of `settings.kafka_version` live (``<cache>/kafka-<version>/lib``)."""
    return settings.cache_dir / f"kafka-{settings.kafka_version}" / "lib"


def require_java() -> str:
    """The path of `java`, or a BrokerError saying what to install."""
    java = shutil.which("java")
    if not java:
        raise BrokerError(
            "`java` not found: the local Kafka broker needs a Java 17+ runtime "
            "(Debian/Ubuntu: apt install openjdk-17-jre-headless; macOS: brew install openjdk@17)"
        )
    return java


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_jars(settings: Settings, progress: Progress = print) -> Path:
    """Fetch the broker's jars from Maven Central on first use; return the directory holding them.

    Instant once done (a marker file records completion). A failed or partial fetch leaves no
    marker and is redone next time. A file lock makes concurrent callers wait for one fetch.
    """
    version = settings.kafka_version
    if not re.fullmatch(r"3\.\d+\.\d+", version):
        raise BrokerError(f"kafka_version={version!r}: expected a Kafka 3.x release such as "
                          "3.9.1 (Kafka 4 dropped protocol versions that aiokafka uses)")
    root = settings.cache_dir / f"kafka-{version}"
    lib = root / "lib"
    if (root / JARS_MARKER).exists():
        return lib
    require_java()
    mvn = shutil.which("mvn")
    if not mvn:
        raise BrokerError(
            "`mvn` not found: rankwatch fetches the Kafka broker's jars from Maven Central with "
            "Apache Maven (Debian/Ubuntu: apt install maven; macOS: brew install maven)"
        )
    with _file_lock(settings.cache_dir / f"kafka-{version}.lock"):
        if (root / JARS_MARKER).exists():  # another process fetched them while we waited
            return lib
        progress(f"fetching Kafka {version} jars from Maven Central (first use only)…")
        t0 = time.monotonic()
        partial = root / "lib.partial"
        shutil.rmtree(partial, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        (root / "pom.xml").write_text(_pom(version))
        cmd = [mvn, "-B", "-q", "-Dstyle.color=never", "-f", str(root / "pom.xml"),
               "dependency:copy-dependencies", f"-DoutputDirectory={partial}"]
        try:
            res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=1800)
        except subprocess.TimeoutExpired:
            raise BrokerError("mvn took more than 30 minutes fetching the Kafka jars") from None
        jars = sorted(p.name for p in partial.glob("*.jar")) if partial.is_dir() else []
        if res.returncode != 0 or not any(j.startswith("kafka_2.13-") for j in jars):
            tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-20:])
            raise BrokerError(
                f"fetching Kafka {version} jars with Maven failed (exit {res.returncode}); "
                f"is Maven Central reachable?\n{tail}"
            )
        shutil.rmtree(lib, ignore_errors=True)
        partial.rename(lib)
        (root / JARS_MARKER).write_text("\n".join(jars) + "\n")
        progress(f"done: {len(jars)} jars in {time.monotonic() - t0:.1f} s ({lib})")
    return lib
