"""A full disk pauses the worker, it does not stop it or lose rows: the embedded database on a
small tmpfs (needs mount permission; skipped without), filled while records arrive, then freed."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ingest.batch import encode_batch
from ingest.units import SECOND as SEC
from rankwatch import stack
from rankwatch.kafka.admin import delete_topics
from tests.conftest import KafkaService, SettingsFactory
from tests.integration.test_ingest_pipeline import Pipeline
from tests.unit.test_poison_decode import valid_columns


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> None:
    """Take every free byte of `path`'s file system."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass


def test_a_full_disk_pauses_ingest_and_it_resumes(kafka: KafkaService,
                                                  settings_factory: SettingsFactory,
                                                  small_disk: Path) -> None:
    settings = settings_factory(kafka_bootstrap=kafka.bootstrap,
                                topic_prefix=f"f{uuid.uuid4().hex[:10]}", kafka_partitions=1,
                                clickhouse_url=f"chdb://{small_disk / 'clickhouse'}")
    p = Pipeline(settings)
    try:
        p.start_worker()
        pid = stack.worker_daemon(settings).pid()
        assert pid is not None
        pub = p.publisher()
        t0 = time.time_ns()
        pub.publish("ops", encode_batch("ops", "before", valid_columns("ops", 100, t0)))
        assert pub.flush(30) == 0
        assert p.wait_count("ops", 100, "job_id = 'before'") == 100
        filler = small_disk / "filler"
        fill(filler)
        for i in range(5):
            pub.publish("ops", encode_batch("ops", "during", valid_columns("ops", 100,
                                                                           t0 + i * SEC)))
        assert pub.flush(30) == 0
        time.sleep(25)  # two metrics ticks and many insert retries on a full disk
        assert stack.worker_daemon(settings).pid() == pid
        os.kill(pid, 0)  # still there
        assert p.count("ops", "job_id = 'during'") < 500  # paused: the disk is full
        log = (settings.home / "logs" / "worker.log").read_text()
        failed = [line for line in log.splitlines() if "insert into ops failed" in line]
        assert failed, log[-3000:]
        print(f"\n{len(failed)} insert retries; the first: {failed[0][-300:]}")
        filler.unlink()
        assert p.wait_count("ops", 500, "job_id = 'during'", timeout=90) == 500
        assert p.count("dlq") == 0  # an outage is waited out, never dead-lettered
        assert stack.worker_daemon(settings).pid() == pid
    finally:
        stack.down(settings, progress=lambda m: None)
        delete_topics(kafka.bootstrap, [s.name for s in settings.topics.specs(1)])
