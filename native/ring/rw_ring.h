/* SPDX-License-Identifier: Apache-2.0 */
/*
 * rankwatch ring: a lock-free ring of fixed-size records in POSIX shared memory, one per rank
 * and tracing component. Producers (threads of the training process) never block: a reserve on a
 * full ring fails, counts a drop and returns NULL. One consumer (the host agent) drains.
 *
 * All functions returning int return 0 or a negative errno; functions returning long return a
 * count or a negative errno. See native/README.md for the protocol.
 */
#ifndef RW_RING_H
#define RW_RING_H

#include <stddef.h>
#include <stdint.h>

#include "rw_record.h"

#ifndef RW_API
#define RW_API __attribute__((visibility("default")))
#endif

#define RW_RING_MAGIC 0x31474e4952575275ull /* "uRWRING1" little-endian */
#define RW_RING_VERSION 1u
#define RW_RING_HDR_SIZE 4096u
#define RW_RING_MIN_CAPACITY 2u
#define RW_RING_MAX_CAPACITY (1u << 24) /* 16 Mi records = 2 GiB */
#define RW_JOB_ID_MAX 64

struct rw_ring;

struct rw_ring_opts {
	uint64_t capacity;  /* records, power of two in [MIN, MAX] */
	int32_t rank;       /* global rank of the producer, -1 unknown */
	uint32_t source;    /* enum rw_source */
	const char *job_id; /* may be NULL; truncated to RW_JOB_ID_MAX - 1 */
};

enum rw_producer_state {
	RW_PRODUCER_DEAD = 0,
	RW_PRODUCER_ALIVE = 1,
	RW_PRODUCER_UNKNOWN = 2, /* pid not visible (another pid namespace, no permission) */
};

struct rw_ring_stat {
	uint64_t capacity;
	uint64_t prod_pos;
	uint64_t cons_pos;
	uint64_t drops;
	uint64_t torn;
	int64_t created_ns;
	int32_t producer_pid;
	int32_t rank;
	uint32_t source;
	uint32_t record_size;
	uint32_t version;
	int32_t producer; /* enum rw_producer_state */
	char job_id[RW_JOB_ID_MAX];
	int64_t pos_step;  /* the producer's current step, -1 unknown (RW_POS_*) */
	int64_t pos_ts;    /* when it entered pos_stage (or left its last stage), ns; 0 unknown */
	int32_t pos_stage; /* 1..RW_POS_STAGES: the stage it is inside; 0 between stages/unknown */
	int32_t pos_pad;
};

/* The producer's position: RW_POS_WORDS int64 words in the ring header (rw_ring__position),
 * each transition one plain store of a monotonic-clock time (any clock: RW_POS_OFFSET converts
 * it to CLOCK_REALTIME ns).
 *   [RW_POS_STEP]      the current step (-1 unknown), stored at a step's start
 *   [RW_POS_OFFSET]    realtime - monotonic clock, ns, stored at a step's start (before the step)
 *   [RW_POS_LEFT]      when the producer last left a stage or began a step
 *   [RW_POS_ENTER + i] when it last entered stage i + 1 (the producer's stage list, from 1)
 * The current stage is the one entered last, unless a stage was left after that. */
#define RW_POS_STEP 0
#define RW_POS_OFFSET 1
#define RW_POS_LEFT 2
#define RW_POS_ENTER 3
#define RW_POS_STAGES 5
#define RW_POS_WORDS (RW_POS_ENTER + RW_POS_STAGES)

/* Drain flags. */
#define RW_DRAIN_SKIP_TORN 1u /* skip uncommitted slots, but only once the producer is dead */

/* Producer: create the segment `name` (a shm_open name, "/rankwatch..."). An existing segment
 * whose producer is dead or is this process, or that was never initialised, is replaced (a
 * reader keeps its mapping of the old one); another live producer's gives -EBUSY, a foreign one
 * (other magic/version/record size) -EEXIST. */
RW_API int rw_ring__create(const char *name, const struct rw_ring_opts *opts,
			   struct rw_ring **out);
/* Consumer: map an existing segment and validate its header (-EPROTO foreign magic,
 * -EPROTONOSUPPORT version, -EBADMSG size/capacity mismatch). */
RW_API int rw_ring__attach(const char *name, struct rw_ring **out);
/* Unmap and free; the shared memory name stays (rw_ring__unlink removes it). */
RW_API void rw_ring__free(struct rw_ring *ring);
RW_API int rw_ring__unlink(const char *name);

/* Reserve one slot; NULL when full (drop counted). Fill it, then rw_ring__commit. */
RW_API struct rw_record *rw_ring__reserve(struct rw_ring *ring);
RW_API void rw_ring__commit(struct rw_ring *ring, struct rw_record *rec);
/* Copy `rec` (its seq is ignored) into the ring: 0 or -ENOSPC (drop counted). */
RW_API int rw_ring__write(struct rw_ring *ring, const struct rw_record *rec);
/* Copy n contiguous records with one reservation; returns how many went in, the rest are
 * counted as drops. */
RW_API long rw_ring__write_batch(struct rw_ring *ring, const void *recs, size_t n);

/* Write the name records for `hash` (text truncated to RW_NAME_MAX bytes, in parts of
 * RW_NAME_PART); -ENOSPC when the ring filled up part-way (the reader drops incomplete names). */
RW_API int rw_ring__write_name(struct rw_ring *ring, uint32_t src, uint16_t ns, uint64_t hash,
			       const char *text);

/* Copy up to max committed records into out (max * RW_RECORD_SIZE bytes), in order, and free
 * their slots. Returns the count (0 when empty). Single consumer only. */
RW_API long rw_ring__drain(struct rw_ring *ring, void *out, size_t max, unsigned int flags);
RW_API int rw_ring__stat(struct rw_ring *ring, struct rw_ring_stat *st);
/* The producer's RW_POS_WORDS position words in the header, for it to store into directly — no
 * call, no lock, nothing that can block; rw_ring__stat reads them back (pos_*). */
RW_API int64_t *rw_ring__position(struct rw_ring *ring);

/* Build "<prefix>.<job>.<rank>.<source>" into buf; -ENAMETOOLONG / -EINVAL on bad input. */
RW_API int rw_ring__name(char *buf, size_t len, const char *prefix, const char *job_id,
			 int rank, const char *source);
/* Layout of every record kind, "kind.field:offset:numpy-type;..." (see ingest/ring.py). */
RW_API const char *rw_record__schema(void);
RW_API int64_t rw_now_ns(void);

#endif /* RW_RING_H */
