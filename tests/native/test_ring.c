// SPDX-License-Identifier: Apache-2.0
/*
 * Ring tests: header validation, wrap-around, drops when full, batch writes, concurrent
 * producers (threads and a separate process) with exact counts and payload checks, and a
 * producer killed between reserve and commit.
 */

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include "rw_ring.h"
#include "rw_test.h"

#define STRESS_PER_PRODUCER 200000ull

static struct rw_ring_opts opts_of(uint64_t cap)
{
	struct rw_ring_opts o = { .capacity = cap, .rank = 3, .source = RW_SRC_PY,
				  .job_id = "test-job" };
	return o;
}

/* Payload derived from (producer, i): a torn record cannot pass check_payload. */
static void fill(struct rw_record *r, uint32_t producer, uint64_t i)
{
	/* Never touch h.seq: the ring owns it and the consumer may be reading it. */
	memset((char *)r + sizeof(r->h.seq), 0, sizeof(*r) - sizeof(r->h.seq));
	r->h.kind = RW_REC_BEAT;
	r->h.src = producer;
	r->h.ts = (int64_t)i;
	for (size_t b = 0; b < sizeof(r->u.raw); b++)
		r->u.raw[b] = (uint8_t)(i * 31 + b + producer * 7);
}

static int payload_ok(const struct rw_record *r)
{
	uint64_t i = (uint64_t)r->h.ts;

	if (r->h.kind != RW_REC_BEAT)
		return 0;
	for (size_t b = 0; b < sizeof(r->u.raw); b++)
		if (r->u.raw[b] != (uint8_t)(i * 31 + b + r->h.src * 7))
			return 0;
	return 1;
}

static void test_create_and_validate(void)
{
	struct rw_ring *p, *c, *x;
	struct rw_ring_opts o = opts_of(6);
	struct rw_ring_stat st;
	char name[64], buf[300];

	TEST_RING_NAME(name, "validate");
	CHECK_EQ(rw_ring__create(name, &o, &p), -EINVAL); /* not a power of two */
	o.capacity = 1u << 25;
	CHECK_EQ(rw_ring__create(name, &o, &p), -EINVAL); /* above the maximum */
	o = opts_of(64);
	CHECK_EQ(rw_ring__create(name, &o, &p), 0);
	pid_t pid = fork(); /* another live process may not take it over */
	CHECK(pid >= 0);
	if (pid == 0)
		_exit(rw_ring__create(name, &o, &x) == -EBUSY ? 0 : 1);
	int status;
	CHECK_EQ(waitpid(pid, &status, 0), pid);
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	CHECK_EQ(rw_ring__attach(name, &c), 0);
	CHECK_EQ(rw_ring__stat(c, &st), 0);
	CHECK_EQ(st.capacity, 64);
	CHECK_EQ(st.rank, 3);
	CHECK_EQ(st.producer_pid, getpid());
	CHECK_EQ(st.producer, RW_PRODUCER_ALIVE);
	CHECK(strcmp(st.job_id, "test-job") == 0);
	/* The same process may replace its own earlier ring (communicators re-created). */
	CHECK_EQ(rw_ring__create(name, &o, &x), 0);
	CHECK_EQ(rw_ring__stat(c, &st), 0); /* the reader's old mapping still works */
	CHECK_EQ(st.capacity, 64);
	rw_ring__free(x);
	rw_ring__free(c);
	rw_ring__free(p);
	CHECK_EQ(rw_ring__unlink(name), 0);
	CHECK_EQ(rw_ring__attach(name, &c), -ENOENT);

	/* A foreign segment: right size, wrong magic. */
	int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
	CHECK(fd >= 0);
	CHECK_EQ(ftruncate(fd, RW_RING_HDR_SIZE + 64 * RW_RECORD_SIZE), 0);
	CHECK_EQ(write(fd, "NOTARING", 8), 8);
	close(fd);
	CHECK_EQ(rw_ring__attach(name, &c), -EPROTO);
	CHECK_EQ(rw_ring__create(name, &o, &p), -EEXIST);
	CHECK_EQ(rw_ring__unlink(name), 0);

	CHECK_EQ(rw_ring__name(buf, sizeof(buf), "/rankwatch", "job-1", 7, "nccl"), 0);
	CHECK(strcmp(buf, "/rankwatch.job-1.7.nccl") == 0);
	CHECK_EQ(rw_ring__name(buf, sizeof(buf), "/rankwatch", "a/b", 7, "nccl"), -EINVAL);
	CHECK_EQ(rw_ring__name(buf, sizeof(buf), "/rankwatch", "j", -1, "nccl"), -EINVAL);
	CHECK_EQ(rw_ring__name(buf, 10, "/rankwatch", "j", 1, "nccl"), -ENAMETOOLONG);
	CHECK(strstr(rw_record__schema(), "op.t_end:80:i8;") != NULL);
}

static void test_wraparound(void)
{
	struct rw_ring *p, *c;
	struct rw_ring_opts o = opts_of(8);
	struct rw_record rec, out[8];
	struct rw_ring_stat st;
	uint64_t next_write = 0, next_read = 0;
	char name[64];

	TEST_RING_NAME(name, "wrap");
	CHECK_EQ(rw_ring__create(name, &o, &p), 0);
	CHECK_EQ(rw_ring__attach(name, &c), 0);
	while (next_read < 1000) {
		for (int k = 0; k < 5; k++) {
			fill(&rec, 1, next_write++);
			CHECK_EQ(rw_ring__write(p, &rec), 0);
		}
		long n = rw_ring__drain(c, out, 8, 0);
		CHECK_EQ(n, 5);
		for (long k = 0; k < n; k++) {
			CHECK(payload_ok(&out[k]));
			CHECK_EQ(out[k].h.ts, next_read++);
		}
	}
	CHECK_EQ(rw_ring__stat(c, &st), 0);
	CHECK_EQ(st.prod_pos, 1000);
	CHECK_EQ(st.cons_pos, 1000);
	CHECK_EQ(st.drops, 0);
	rw_ring__free(c);
	rw_ring__free(p);
	rw_ring__unlink(name);
}

static void test_full_drops_and_batch(void)
{
	struct rw_ring *p, *c;
	struct rw_ring_opts o = opts_of(16);
	struct rw_record recs[20], out[32];
	struct rw_ring_stat st;
	char name[64];

	TEST_RING_NAME(name, "full");
	CHECK_EQ(rw_ring__create(name, &o, &p), 0);
	CHECK_EQ(rw_ring__attach(name, &c), 0);
	for (int i = 0; i < 20; i++) {
		fill(&recs[i], 2, (uint64_t)i);
		CHECK_EQ(rw_ring__write(p, &recs[i]), i < 16 ? 0 : -ENOSPC);
	}
	CHECK(rw_ring__reserve(p) == NULL);
	CHECK_EQ(rw_ring__stat(c, &st), 0);
	CHECK_EQ(st.drops, 5);
	CHECK_EQ(rw_ring__drain(c, out, 32, 0), 16);
	for (int i = 0; i < 16; i++)
		CHECK_EQ(out[i].h.ts, i);
	CHECK_EQ(rw_ring__drain(c, out, 32, 0), 0);
	/* A batch reserves once; what does not fit is dropped and counted. */
	CHECK_EQ(rw_ring__write_batch(p, recs, 10), 10);
	CHECK_EQ(rw_ring__write_batch(p, recs + 10, 10), 6);
	CHECK_EQ(rw_ring__stat(c, &st), 0);
	CHECK_EQ(st.drops, 9);
	CHECK_EQ(rw_ring__drain(c, out, 4, 0), 4); /* a partial drain keeps the rest */
	CHECK_EQ(rw_ring__drain(c, out + 4, 32, 0), 12);
	for (int i = 0; i < 16; i++) {
		CHECK(payload_ok(&out[i]));
		CHECK_EQ(out[i].h.ts, i);
	}
	rw_ring__free(c);
	rw_ring__free(p);
	rw_ring__unlink(name);
}

struct stress {
	struct rw_ring *ring;
	uint32_t producer;
	uint64_t written;
	uint64_t failed; /* reserves that found the ring full (the ring counts them as drops) */
	atomic_int *done;
};

static void *producer_main(void *arg)
{
	struct stress *s = arg;
	struct rw_record *r;

	for (uint64_t i = 0; i < STRESS_PER_PRODUCER; i++) {
		/* Retry until the record goes in, so every record crosses the ring while the
		 * consumer runs; each failed reserve is a drop the ring must have counted. */
		while (!(r = rw_ring__reserve(s->ring))) {
			s->failed++;
			sched_yield();
		}
		fill(r, s->producer, i);
		rw_ring__commit(s->ring, r);
		s->written++;
	}
	atomic_fetch_add(s->done, 1);
	return NULL;
}

/* Drain until `done` reaches `nproducers` and the ring is empty; checks per-producer order. */
static uint64_t consume(struct rw_ring *c, atomic_int *done, int nproducers, uint64_t *last)
{
	static struct rw_record out[256];
	uint64_t got = 0;

	for (;;) {
		int finished = atomic_load(done) == nproducers;
		long n = rw_ring__drain(c, out, 256, 0);

		CHECK(n >= 0);
		for (long k = 0; k < n; k++) {
			uint32_t pr = out[k].h.src;

			CHECK(pr < 4);
			CHECK(payload_ok(&out[k]));
			CHECK(last[pr] == UINT64_MAX || (uint64_t)out[k].h.ts > last[pr]);
			last[pr] = (uint64_t)out[k].h.ts;
		}
		got += (uint64_t)n;
		if (!n && finished)
			return got;
	}
}

static void test_threads_stress(void)
{
	struct rw_ring *p, *c;
	struct rw_ring_opts o = opts_of(1024);
	struct stress s[2];
	pthread_t t[2];
	atomic_int done = 0;
	uint64_t last[4] = { UINT64_MAX, UINT64_MAX, UINT64_MAX, UINT64_MAX };
	struct rw_ring_stat st;
	char name[64];

	TEST_RING_NAME(name, "threads");
	CHECK_EQ(rw_ring__create(name, &o, &p), 0);
	/* The consumer thread uses the producers' mapping: ThreadSanitizer tracks addresses, and
	 * a second mapping of the same pages would hide the acquire/release pairs from it. */
	c = p;
	for (int i = 0; i < 2; i++) {
		s[i] = (struct stress){ .ring = p, .producer = (uint32_t)i + 1, .done = &done };
		CHECK_EQ(pthread_create(&t[i], NULL, producer_main, &s[i]), 0);
	}
	uint64_t got = consume(c, &done, 2, last);
	for (int i = 0; i < 2; i++)
		pthread_join(t[i], NULL);
	CHECK_EQ(rw_ring__stat(c, &st), 0);
	CHECK_EQ(got, 2 * STRESS_PER_PRODUCER);
	CHECK_EQ(s[0].written + s[1].written, got);
	CHECK_EQ(st.drops, s[0].failed + s[1].failed);
	printf("  threads: %llu received, %llu failed reserves\n", (unsigned long long)got,
	       (unsigned long long)st.drops);
	rw_ring__free(p);
	rw_ring__unlink(name);
}

static void test_process_stress(void)
{
	struct rw_ring *p, *c;
	struct rw_ring_opts o = opts_of(4096);
	uint64_t last[4] = { UINT64_MAX, UINT64_MAX, UINT64_MAX, UINT64_MAX };
	struct rw_ring_stat st;
	char name[64];
	int status;

	TEST_RING_NAME(name, "proc");
	CHECK_EQ(rw_ring__create(name, &o, &p), 0);
	CHECK_EQ(rw_ring__attach(name, &c), 0);
	/* done lives in shared memory so the child can tell the parent it finished. */
	atomic_int *done = mmap(NULL, sizeof(*done), PROT_READ | PROT_WRITE,
				MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	CHECK(done != MAP_FAILED);
	atomic_store(done, 0);
	pid_t pid = fork();
	CHECK(pid >= 0);
	if (pid == 0) {
		struct stress s = { .ring = p, .producer = 3, .done = done };

		producer_main(&s);
		_exit(0);
	}
	uint64_t got = consume(c, done, 1, last);
	CHECK_EQ(waitpid(pid, &status, 0), pid);
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	CHECK_EQ(rw_ring__stat(c, &st), 0);
	CHECK_EQ(got, STRESS_PER_PRODUCER);
	CHECK_EQ(last[3], STRESS_PER_PRODUCER - 1);
	CHECK_EQ(st.torn, 0);
	printf("  process: %llu received, %llu failed reserves\n", (unsigned long long)got,
	       (unsigned long long)st.drops);
	munmap(done, sizeof(*done));
	rw_ring__free(c);
	rw_ring__free(p);
	rw_ring__unlink(name);
}

/* The child writes 10 records, reserves A and writes half of it, then writes and commits B and
 * C after A (as a second thread would), and is killed. The reader must get the 10, then - only
 * with SKIP_TORN and because the child is dead - skip A and get B and C; never A's half. */
static void test_killed_mid_write(void)
{
	struct rw_ring *p, *c, *again;
	struct rw_ring_opts o = opts_of(64);
	struct rw_record out[64], rec;
	struct rw_ring_stat st;
	char name[64];
	int status;

	TEST_RING_NAME(name, "killed");
	CHECK_EQ(rw_ring__create(name, &o, &p), 0);
	pid_t pid = fork();
	CHECK(pid >= 0);
	if (pid == 0) {
		struct rw_ring *cp;

		/* The child is the producer of its own segment, as a training process is. */
		rw_ring__free(p);
		rw_ring__unlink(name);
		if (rw_ring__create(name, &o, &cp))
			_exit(2);
		for (uint64_t i = 0; i < 10; i++) {
			fill(&rec, 1, i);
			rw_ring__write(cp, &rec);
		}
		struct rw_record *a = rw_ring__reserve(cp);
		memset(&a->u.raw, 0xAB, sizeof(a->u.raw) / 2);
		a->h.kind = RW_REC_BEAT;
		fill(&rec, 1, 11);
		rw_ring__write(cp, &rec);
		fill(&rec, 1, 12);
		rw_ring__write(cp, &rec);
		raise(SIGKILL);
		_exit(3);
	}
	CHECK_EQ(waitpid(pid, &status, 0), pid);
	CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
	rw_ring__free(p);
	CHECK_EQ(rw_ring__attach(name, &c), 0);
	CHECK_EQ(rw_ring__stat(c, &st), 0);
	CHECK_EQ(st.producer, RW_PRODUCER_DEAD);
	CHECK_EQ(st.producer_pid, pid);
	CHECK_EQ(st.prod_pos, 13);
	CHECK_EQ(rw_ring__drain(c, out, 64, 0), 10);
	CHECK_EQ(rw_ring__drain(c, out, 64, 0), 0); /* stuck at A without SKIP_TORN */
	CHECK_EQ(rw_ring__drain(c, out, 64, RW_DRAIN_SKIP_TORN), 2);
	CHECK(payload_ok(&out[0]) && out[0].h.ts == 11);
	CHECK(payload_ok(&out[1]) && out[1].h.ts == 12);
	CHECK_EQ(rw_ring__stat(c, &st), 0);
	CHECK_EQ(st.torn, 1);
	CHECK_EQ(st.cons_pos, 13);
	/* A new producer may replace the stale segment; the old mapping stays readable. */
	CHECK_EQ(rw_ring__create(name, &o, &again), 0);
	CHECK_EQ(rw_ring__stat(c, &st), 0);
	CHECK_EQ(st.cons_pos, 13);
	rw_ring__free(again);
	rw_ring__free(c);
	rw_ring__unlink(name);
}

/* SKIP_TORN must not skip a slot whose producer is alive: the record is merely in progress. */
static void test_no_skip_while_alive(void)
{
	struct rw_ring *p, *c;
	struct rw_ring_opts o = opts_of(8);
	struct rw_record out[8];
	char name[64];

	TEST_RING_NAME(name, "alive");
	CHECK_EQ(rw_ring__create(name, &o, &p), 0);
	CHECK_EQ(rw_ring__attach(name, &c), 0);
	struct rw_record *a = rw_ring__reserve(p);
	CHECK(a != NULL);
	CHECK_EQ(rw_ring__drain(c, out, 8, RW_DRAIN_SKIP_TORN), 0);
	a->h.kind = RW_REC_BEAT;
	rw_ring__commit(p, a);
	CHECK_EQ(rw_ring__drain(c, out, 8, RW_DRAIN_SKIP_TORN), 1);
	rw_ring__free(c);
	rw_ring__free(p);
	rw_ring__unlink(name);
}

int main(void)
{
	setvbuf(stdout, NULL, _IOLBF, 0); /* forked children must not repeat buffered lines */
	RUN(test_create_and_validate);
	RUN(test_wraparound);
	RUN(test_full_drops_and_batch);
	RUN(test_no_skip_while_alive);
	RUN(test_threads_stress);
	RUN(test_process_stress);
	RUN(test_killed_mid_write);
	printf("test_ring: %d checks passed\n", atomic_load(&rw_test_checks));
	return 0;
}
