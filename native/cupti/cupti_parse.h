/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The CUPTI injector's pure core, testable without CUDA: turning CUPTI kernel activity records
 * into ring records, the set of kernel names already sent, the pool of pre-allocated activity
 * buffers, and the decision whether a process is a training worker at all (ARGUS App. A).
 *
 * The record layout is CUpti_ActivityKernel9 from the CUPTI 12.9 headers the Makefile fetches;
 * CUPTI_ACTIVITY_KIND_KERNEL and _CONCURRENT_KERNEL records share it.
 */
#ifndef RW_CUPTI_PARSE_H
#define RW_CUPTI_PARSE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <cupti_activity.h>

#include "rw_ring.h"

typedef CUpti_ActivityKernel9 rw_cupti_kernel;

/* Next record of an activity buffer: 0 and *rec set, or non-zero at the end. In the injector
 * this is cuptiActivityGetNextRecord; tests use rw_cupti__next_packed. */
typedef int (*rw_cupti_next_fn)(uint8_t *buf, size_t valid, CUpti_Activity **rec);

/* Kernel names already sent, as an open-addressing set of hashes with a fixed capacity. */
struct rw_name_set {
	uint64_t *slots;
	size_t cap; /* power of two */
	size_t used;
};

struct rw_cupti_stats {
	uint64_t kernels;    /* kernel records converted */
	uint64_t written;    /* kernel records that went into the ring */
	uint64_t other;      /* activity records of other kinds, skipped */
	uint64_t names;      /* names sent */
	uint64_t names_full; /* names not sent because the set was full */
};

struct rw_cupti_sink {
	struct rw_ring *ring;
	int64_t clock_offset; /* realtime ns - CUPTI timestamp ns, measured at start */
	struct rw_name_set *names;
	struct rw_cupti_stats *stats;
};

/* Convert every kernel record of a completed buffer into the ring; returns kernels seen. */
size_t rw_cupti__parse(uint8_t *buf, size_t valid, rw_cupti_next_fn next,
		       struct rw_cupti_sink *sink);
/* One kernel record -> a `kernels` ring record payload. */
void rw_cupti__convert(const rw_cupti_kernel *k, int64_t clock_offset,
		       struct rw_rec_kernel *out);
/* Iterator over a buffer of contiguous rw_cupti_kernel records (synthetic buffers). */
int rw_cupti__next_packed(uint8_t *buf, size_t valid, CUpti_Activity **rec);

int rw_name_set__init(struct rw_name_set *set, size_t cap);
void rw_name_set__free(struct rw_name_set *set);
/* 1 newly added, 0 already there, -ENOSPC full (more than 3/4 used). */
int rw_name_set__add(struct rw_name_set *set, uint64_t hash);

/* Fixed pool of equal buffers (at most 64), taken and given back without locks. */
struct rw_buf_pool {
	uint8_t *mem;
	size_t nbufs, size;
	_Atomic uint64_t free_mask;
	_Atomic uint64_t empty; /* takes that found no free buffer */
};

int rw_buf_pool__init(struct rw_buf_pool *pool, size_t nbufs, size_t size);
void rw_buf_pool__free(struct rw_buf_pool *pool);
uint8_t *rw_buf_pool__take(struct rw_buf_pool *pool);
/* -EINVAL if buf is not a buffer of this pool, or is already free. */
int rw_buf_pool__give(struct rw_buf_pool *pool, uint8_t *buf);

/* Should this process be traced? `has_rank`: RANK or LOCAL_RANK is set; `allow`/`deny`:
 * comma-separated lists (see native/README.md); allow "*" or "" allows any name. Returns 1 to trace, else 0 and a reason. */
int rw_cupti__selected(int argc, char *const argv[], int has_rank, const char *allow,
		       const char *deny, const char **why);

#endif /* RW_CUPTI_PARSE_H */
