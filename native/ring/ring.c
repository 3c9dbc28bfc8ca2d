// SPDX-License-Identifier: Apache-2.0
/*
 * rankwatch ring: fixed-size records in POSIX shared memory.
 *
 * Layout: a 4 KiB header page, then `capacity` slots of RW_RECORD_SIZE bytes. Positions are
 * free-running 64-bit counters; slot = pos & (capacity - 1).
 *
 *   prod_pos  next position to reserve. Producers advance it with a CAS, so several threads of
 *             one process may write (NCCL calls the profiler from the user thread and the proxy
 *             thread); with one producer thread the CAS never retries.
 *   cons_pos  next position to read; only the consumer stores it.
 *   slot.seq  the commit word of each slot, like libbpf's busy bit: a reserve stores
 *             (pos + 1) | RW_SEQ_BUSY, the commit stores pos + 1 with release. The consumer
 *             reads slot pos only when seq == pos + 1, so it never sees a record that is being
 *             written, and a value left from the previous lap (pos + 1 - capacity) never matches.
 *
 * A producer killed between reserve and commit leaves a BUSY slot that would stop the consumer
 * forever; rw_ring__drain with RW_DRAIN_SKIP_TORN skips such slots (counting them as torn), but
 * only after checking that the producer process is gone, because skipping a live writer's slot
 * would let the next lap write into it concurrently.
 */

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "rw_ring.h"

#define RW_SEQ_BUSY (1ull << 63)

_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2, "64-bit atomics must be lock-free to be shared");

struct rw_ring_hdr {
	_Atomic uint64_t magic; /* stored last by the creator, with release */
	uint32_t version;
	uint32_t hdr_size;
	uint32_t record_size;
	uint32_t source;
	uint64_t capacity;
	int32_t producer_pid;
	int32_t rank;
	uint64_t producer_start; /* /proc/<pid>/stat starttime; tells pid reuse apart */
	int64_t created_ns;
	char job_id[RW_JOB_ID_MAX];
	alignas(64) _Atomic uint64_t prod_pos;
	alignas(64) _Atomic uint64_t cons_pos;
	alignas(64) _Atomic uint64_t drops; /* reserves that failed because the ring was full */
	_Atomic uint64_t torn;              /* slots skipped after their producer died */
	/* The producer's position (rw_ring__position, RW_POS_*): plain stores by the producer, one
	 * word per transition; rw_ring__stat derives step, stage and entry time from them. */
	alignas(64) _Atomic int64_t pos[RW_POS_WORDS];
};

_Static_assert(sizeof(struct rw_ring_hdr) <= RW_RING_HDR_SIZE, "header fits its page");

struct rw_ring {
	struct rw_ring_hdr *hdr;
	struct rw_record *slots;
	uint64_t mask;
	size_t map_size;
};

int64_t rw_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

/* Field 22 of /proc/<pid>/stat: start time in clock ticks since boot; 0 when unreadable. */
static uint64_t proc__start_time(pid_t pid)
{
	char path[64], buf[1024];
	unsigned long long start = 0;
	ssize_t n;
	int fd;

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = '\0';
	/* comm may contain spaces and parentheses: fields restart after the last ')'. */
	char *p = strrchr(buf, ')');
	if (!p || sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d "
			 "%*d %*d %*d %*d %llu", &start) != 1)
		return 0;
	return start;
}

static int hdr__producer_state(const struct rw_ring_hdr *hdr)
{
	pid_t pid = hdr->producer_pid;

	if (pid <= 0)
		return RW_PRODUCER_UNKNOWN;
	if (kill(pid, 0) < 0 && errno == ESRCH)
		return RW_PRODUCER_DEAD;
	if (hdr->producer_start) {
		uint64_t now = proc__start_time(pid);

		if (!now)
			return RW_PRODUCER_UNKNOWN;
		if (now != hdr->producer_start)
			return RW_PRODUCER_DEAD; /* the pid was reused by another process */
	}
	return RW_PRODUCER_ALIVE;
}

static int ring__check_capacity(uint64_t cap, size_t *map_size)
{
	if (cap < RW_RING_MIN_CAPACITY || cap > RW_RING_MAX_CAPACITY || (cap & (cap - 1)))
		return -EINVAL;
	/* cap <= 2^24 and the record size is 128, so this cannot overflow size_t on 64-bit;
	 * check anyway so a change of the limits cannot silently wrap. */
	if (cap > (SIZE_MAX - RW_RING_HDR_SIZE) / RW_RECORD_SIZE)
		return -E2BIG;
	*map_size = RW_RING_HDR_SIZE + (size_t)cap * RW_RECORD_SIZE;
	return 0;
}

/* Validate a mapped header; hdr must be at least RW_RING_HDR_SIZE bytes. */
static int hdr__validate(struct rw_ring_hdr *hdr, size_t file_size, size_t *map_size)
{
	/* Pairs with the store-release of magic in rw_ring__create: once the magic is seen, the
	 * rest of the header is initialised. */
	uint64_t magic = atomic_load_explicit(&hdr->magic, memory_order_acquire);

	if (magic != RW_RING_MAGIC)
		return -EPROTO;
	if (hdr->version != RW_RING_VERSION)
		return -EPROTONOSUPPORT;
	if (hdr->hdr_size != RW_RING_HDR_SIZE || hdr->record_size != RW_RECORD_SIZE)
		return -EBADMSG;
	if (ring__check_capacity(hdr->capacity, map_size) || *map_size != file_size)
		return -EBADMSG;
	return 0;
}

static int ring__map(int fd, size_t size, int writable, struct rw_ring **out)
{
	struct rw_ring *ring = calloc(1, sizeof(*ring));
	void *mem;

	if (!ring)
		return -ENOMEM;
	mem = mmap(NULL, size, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, 0);
	if (mem == MAP_FAILED) {
		int err = -errno;

		free(ring);
		return err;
	}
	ring->hdr = mem;
	ring->slots = (struct rw_record *)((char *)mem + RW_RING_HDR_SIZE);
	ring->map_size = size;
	ring->mask = (size - RW_RING_HDR_SIZE) / RW_RECORD_SIZE - 1;
	*out = ring;
	return 0;
}

/* Decide whether an existing segment may be replaced by a new producer. */
static int ring__check_existing(const char *name)
{
	struct rw_ring_hdr *hdr;
	struct stat st;
	size_t map_size;
	int fd, err = 0;

	fd = shm_open(name, O_RDONLY | O_CLOEXEC, 0);
	if (fd < 0)
		return errno == ENOENT ? 0 : -errno;
	if (fstat(fd, &st) < 0) {
		err = -errno;
		goto cleanup;
	}
	if ((size_t)st.st_size < RW_RING_HDR_SIZE)
		goto cleanup; /* a creator died before sizing it: replaceable */
	hdr = mmap(NULL, RW_RING_HDR_SIZE, PROT_READ, MAP_SHARED, fd, 0);
	if (hdr == MAP_FAILED) {
		err = -errno;
		goto cleanup;
	}
	if (atomic_load_explicit(&hdr->magic, memory_order_acquire) == 0)
		err = 0; /* never initialised */
	else if (hdr__validate(hdr, (size_t)st.st_size, &map_size))
		err = -EEXIST;
	else if (hdr__producer_state(hdr) != RW_PRODUCER_DEAD &&
		 !(hdr->producer_pid == (int32_t)getpid() &&
		   hdr->producer_start == proc__start_time(getpid())))
		err = -EBUSY; /* another live process; our own earlier ring may be replaced */
	munmap(hdr, RW_RING_HDR_SIZE);
cleanup:
	close(fd);
	return err;
}

int rw_ring__create(const char *name, const struct rw_ring_opts *opts, struct rw_ring **out)
{
	struct rw_ring *ring = NULL;
	struct rw_ring_hdr *hdr;
	size_t map_size;
	int fd = -1, err;

	if (!name || !opts || !out)
		return -EINVAL;
	err = ring__check_capacity(opts->capacity, &map_size);
	if (err)
		return err;
	err = ring__check_existing(name);
	if (err)
		return err;
	shm_unlink(name); /* stale or absent; ENOENT is fine */
	fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (fd < 0)
		return -errno; /* EEXIST: another producer won the race */
	if (ftruncate(fd, (off_t)map_size) < 0) {
		err = -errno;
		goto cleanup;
	}
	err = ring__map(fd, map_size, 1, &ring);
	if (err)
		goto cleanup;
	hdr = ring->hdr;
	hdr->version = RW_RING_VERSION;
	hdr->hdr_size = RW_RING_HDR_SIZE;
	hdr->record_size = RW_RECORD_SIZE;
	hdr->source = opts->source;
	hdr->capacity = opts->capacity;
	hdr->producer_pid = (int32_t)getpid();
	hdr->producer_start = proc__start_time(getpid());
	hdr->rank = opts->rank;
	hdr->created_ns = rw_now_ns();
	if (opts->job_id)
		snprintf(hdr->job_id, sizeof(hdr->job_id), "%s", opts->job_id);
	atomic_store_explicit(&hdr->prod_pos, 0, memory_order_relaxed);
	atomic_store_explicit(&hdr->cons_pos, 0, memory_order_relaxed);
	atomic_store_explicit(&hdr->drops, 0, memory_order_relaxed);
	atomic_store_explicit(&hdr->torn, 0, memory_order_relaxed);
	for (int i = 0; i < RW_POS_WORDS; i++)
		atomic_store_explicit(&hdr->pos[i], i == RW_POS_STEP ? -1 : 0, memory_order_relaxed);
	/* Pairs with the load-acquire of magic in hdr__validate: publishes the header. */
	atomic_store_explicit(&hdr->magic, RW_RING_MAGIC, memory_order_release);
	*out = ring;
	ring = NULL;
cleanup:
	if (err)
		shm_unlink(name);
	close(fd);
	free(ring);
	return err;
}

int rw_ring__attach(const char *name, struct rw_ring **out)
{
	struct rw_ring_hdr *hdr;
	struct stat st;
	size_t map_size;
	int fd, err;

	if (!name || !out)
		return -EINVAL;
	fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	if (fstat(fd, &st) < 0) {
		err = -errno;
		goto cleanup;
	}
	if ((size_t)st.st_size < RW_RING_HDR_SIZE) {
		err = -EBADMSG;
		goto cleanup;
	}
	hdr = mmap(NULL, RW_RING_HDR_SIZE, PROT_READ, MAP_SHARED, fd, 0);
	if (hdr == MAP_FAILED) {
		err = -errno;
		goto cleanup;
	}
	err = hdr__validate(hdr, (size_t)st.st_size, &map_size);
	munmap(hdr, RW_RING_HDR_SIZE);
	if (err)
		goto cleanup;
	err = ring__map(fd, map_size, 1, out);
cleanup:
	close(fd);
	return err;
}

void rw_ring__free(struct rw_ring *ring)
{
	if (!ring)
		return;
	munmap(ring->hdr, ring->map_size);
	free(ring);
}

int rw_ring__unlink(const char *name)
{
	return shm_unlink(name) < 0 ? -errno : 0;
}

/* Reserve n consecutive positions, or as many as fit; returns the first in *pos. */
static uint64_t ring__reserve_n(struct rw_ring *ring, uint64_t n, uint64_t *pos)
{
	struct rw_ring_hdr *hdr = ring->hdr;
	uint64_t cap = ring->mask + 1, p, cons, used, k;

	p = atomic_load_explicit(&hdr->prod_pos, memory_order_relaxed);
	for (;;) {
		/* Pairs with the store-release of cons_pos in rw_ring__drain: slots below cons have
		 * been copied out by the consumer, so they may be overwritten. */
		cons = atomic_load_explicit(&hdr->cons_pos, memory_order_acquire);
		used = p - cons;
		if (used > cap) { /* p is stale: other producers and the consumer moved past it */
			p = atomic_load_explicit(&hdr->prod_pos, memory_order_relaxed);
			continue;
		}
		k = n < cap - used ? n : cap - used;
		if (!k)
			break;
		/* Relaxed is enough: the CAS only hands out positions; the record is published
		 * through slot.seq. On failure p is reloaded. */
		if (atomic_compare_exchange_weak_explicit(&hdr->prod_pos, &p, p + k,
							  memory_order_relaxed, memory_order_relaxed))
			break;
	}
	if (k < n)
		atomic_fetch_add_explicit(&hdr->drops, n - k, memory_order_relaxed);
	*pos = p;
	return k;
}

struct rw_record *rw_ring__reserve(struct rw_ring *ring)
{
	struct rw_record *rec;
	uint64_t pos;

	if (!ring__reserve_n(ring, 1, &pos))
		return NULL;
	rec = &ring->slots[pos & ring->mask];
	/* Busy marker, for readers that look at a dead producer's ring; the consumer only trusts
	 * seq == pos + 1, which this value never equals. */
	__atomic_store_n(&rec->h.seq, (pos + 1) | RW_SEQ_BUSY, __ATOMIC_RELAXED);
	return rec;
}

void rw_ring__commit(struct rw_ring *ring, struct rw_record *rec)
{
	uint64_t seq = __atomic_load_n(&rec->h.seq, __ATOMIC_RELAXED) & ~RW_SEQ_BUSY;

	(void)ring;
	/* Pairs with the load-acquire of seq in rw_ring__drain: the payload written before this
	 * store is visible to the consumer that sees seq == pos + 1. */
	__atomic_store_n(&rec->h.seq, seq, __ATOMIC_RELEASE);
}

int rw_ring__write(struct rw_ring *ring, const struct rw_record *src)
{
	struct rw_record *rec = rw_ring__reserve(ring);

	if (!rec)
		return -ENOSPC;
	memcpy((char *)rec + sizeof(rec->h.seq), (const char *)src + sizeof(src->h.seq),
	       RW_RECORD_SIZE - sizeof(rec->h.seq));
	rw_ring__commit(ring, rec);
	return 0;
}

long rw_ring__write_batch(struct rw_ring *ring, const void *recs, size_t n)
{
	const struct rw_record *src = recs;
	uint64_t pos, k, i;

	if (!ring || (!recs && n))
		return -EINVAL;
	if (!n)
		return 0;
	k = ring__reserve_n(ring, n, &pos);
	for (i = 0; i < k; i++) {
		struct rw_record *rec = &ring->slots[(pos + i) & ring->mask];

		__atomic_store_n(&rec->h.seq, (pos + i + 1) | RW_SEQ_BUSY, __ATOMIC_RELAXED);
		memcpy((char *)rec + sizeof(rec->h.seq), (const char *)&src[i] + sizeof(src->h.seq),
		       RW_RECORD_SIZE - sizeof(rec->h.seq));
		/* Pairs with the load-acquire of seq in rw_ring__drain (as in rw_ring__commit). */
		__atomic_store_n(&rec->h.seq, pos + i + 1, __ATOMIC_RELEASE);
	}
	return (long)k;
}

long rw_ring__drain(struct rw_ring *ring, void *out, size_t max, unsigned int flags)
{
	struct rw_ring_hdr *hdr;
	struct rw_record *dst = out;
	uint64_t cons, prod, seq, n = 0, torn = 0;
	int dead = -1; /* checked at most once per call, and only when a slot is stuck */

	if (!ring || (!out && max))
		return -EINVAL;
	hdr = ring->hdr;
	cons = atomic_load_explicit(&hdr->cons_pos, memory_order_relaxed); /* we own it */
	while (n < max) {
		struct rw_record *rec = &ring->slots[cons & ring->mask];

		/* Pairs with the store-release of seq in rw_ring__commit/write_batch. */
		seq = __atomic_load_n(&rec->h.seq, __ATOMIC_ACQUIRE);
		if (seq == cons + 1) {
			memcpy(&dst[n++], rec, RW_RECORD_SIZE);
			cons++;
			continue;
		}
		if (!(flags & RW_DRAIN_SKIP_TORN))
			break;
		/* Pairs with the CAS on prod_pos only through the producer's death: once the
		 * producer is gone, prod_pos no longer moves and every slot below it was reserved. */
		prod = atomic_load_explicit(&hdr->prod_pos, memory_order_acquire);
		if (cons >= prod)
			break;
		if (dead < 0)
			dead = hdr__producer_state(hdr) == RW_PRODUCER_DEAD;
		if (!dead)
			break;
		torn++;
		cons++;
	}
	if (torn)
		atomic_fetch_add_explicit(&hdr->torn, torn, memory_order_relaxed);
	/* Pairs with the load-acquire of cons_pos in ring__reserve_n: our copies are done before
	 * producers may reuse the slots. */
	atomic_store_explicit(&hdr->cons_pos, cons, memory_order_release);
	return (long)n;
}

static void pos__read(struct rw_ring_hdr *hdr, struct rw_ring_stat *st);

int rw_ring__stat(struct rw_ring *ring, struct rw_ring_stat *st)
{
	struct rw_ring_hdr *hdr;

	if (!ring || !st)
		return -EINVAL;
	hdr = ring->hdr;
	memset(st, 0, sizeof(*st));
	st->capacity = hdr->capacity;
	st->prod_pos = atomic_load_explicit(&hdr->prod_pos, memory_order_relaxed);
	st->cons_pos = atomic_load_explicit(&hdr->cons_pos, memory_order_relaxed);
	st->drops = atomic_load_explicit(&hdr->drops, memory_order_relaxed);
	st->torn = atomic_load_explicit(&hdr->torn, memory_order_relaxed);
	st->created_ns = hdr->created_ns;
	st->producer_pid = hdr->producer_pid;
	st->rank = hdr->rank;
	st->source = hdr->source;
	st->record_size = hdr->record_size;
	st->version = hdr->version;
	st->producer = hdr__producer_state(hdr);
	memcpy(st->job_id, hdr->job_id, sizeof(st->job_id));
	st->job_id[sizeof(st->job_id) - 1] = '\0';
	pos__read(hdr, st);
	return 0;
}

/* The position from the producer's words: the stage with the latest entry, unless the producer
 * left a stage (or began a step) after it. Each transition is one store, so two equal reads of
 * all words are a state the producer was in; a producer racing us past every try leaves the
 * last read, at worst one transition off. */
static void pos__read(struct rw_ring_hdr *hdr, struct rw_ring_stat *st)
{
	int64_t w[RW_POS_WORDS], again[RW_POS_WORDS];
	int64_t latest = 0;
	int stage = 0;

	for (int tries = 0; tries < 8; tries++) {
		for (int i = 0; i < RW_POS_WORDS; i++)
			w[i] = atomic_load_explicit(&hdr->pos[i], memory_order_acquire);
		for (int i = 0; i < RW_POS_WORDS; i++)
			again[i] = atomic_load_explicit(&hdr->pos[i], memory_order_acquire);
		if (!memcmp(w, again, sizeof(w)))
			break;
	}
	for (int i = 1; i <= RW_POS_STAGES; i++) {
		int64_t t = w[RW_POS_ENTER + i - 1];

		if (t > latest) {
			latest = t;
			stage = i;
		}
	}
	if (w[RW_POS_LEFT] >= latest) {
		latest = w[RW_POS_LEFT];
		stage = 0;
	}
	st->pos_step = w[RW_POS_STEP] >= -1 ? w[RW_POS_STEP] : -1;
	st->pos_stage = stage;
	st->pos_ts = latest > 0 && w[RW_POS_OFFSET] > -latest ? latest + w[RW_POS_OFFSET] : 0;
}

int64_t *rw_ring__position(struct rw_ring *ring)
{
	/* Naturally aligned int64s in the shared header: a producer's plain 8-byte store is atomic
	 * on every platform rankwatch builds for, and the pointer lets an interpreter store them
	 * without a library call. */
	return ring ? (int64_t *)ring->hdr->pos : NULL;
}

static int name__valid_part(const char *s)
{
	if (!s || !*s)
		return 0;
	for (; *s; s++)
		if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') ||
		      (*s >= '0' && *s <= '9') || *s == '-' || *s == '_'))
			return 0;
	return 1;
}

int rw_ring__name(char *buf, size_t len, const char *prefix, const char *job_id, int rank,
		  const char *source)
{
	int n;

	if (!buf || !prefix || prefix[0] != '/' || strchr(prefix + 1, '/') || rank < 0 ||
	    !name__valid_part(job_id) || !name__valid_part(source))
		return -EINVAL;
	n = snprintf(buf, len, "%s.%s.%d.%s", prefix, job_id, rank, source);
	if (n < 0 || (size_t)n >= len || n > 255)
		return -ENAMETOOLONG;
	return 0;
}
