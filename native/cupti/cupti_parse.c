// SPDX-License-Identifier: Apache-2.0
/* The CUPTI injector's pure core (see cupti_parse.h). No CUDA calls: everything here runs on
 * synthetic buffers in tests. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "cupti_parse.h"

#define RW_KERNEL_NAME_SCAN 4096 /* bytes of a kernel name hashed (mangled names are long) */

void rw_cupti__convert(const rw_cupti_kernel *k, int64_t clock_offset,
		       struct rw_rec_kernel *out)
{
	memset(out, 0, sizeof(*out));
	out->name_hash = rw_hash__str(k->name ? k->name : "<unknown>", RW_KERNEL_NAME_SCAN);
	out->t_start = (int64_t)k->start + clock_offset;
	out->duration = k->end > k->start ? k->end - k->start : 0;
	out->stream = k->streamId;
	out->device = k->deviceId;
	out->context = k->contextId;
	out->correlation = k->correlationId;
	out->grid[0] = (uint32_t)k->gridX;
	out->grid[1] = (uint32_t)k->gridY;
	out->grid[2] = (uint32_t)k->gridZ;
	out->block[0] = (uint32_t)k->blockX;
	out->block[1] = (uint32_t)k->blockY;
	out->block[2] = (uint32_t)k->blockZ;
	out->shared_mem = (uint32_t)k->staticSharedMemory + (uint32_t)k->dynamicSharedMemory;
	out->registers = k->registersPerThread;
}

static void parse__kernel(const rw_cupti_kernel *k, struct rw_cupti_sink *sink)
{
	struct rw_record *rec;
	struct rw_rec_kernel kr;

	rw_cupti__convert(k, sink->clock_offset, &kr);
	sink->stats->kernels++;
	int added = sink->names ? rw_name_set__add(sink->names, kr.name_hash) : 0;
	if (added == 1) {
		/* A name the ring could not take is forgotten, so it is sent again next time. */
		if (rw_ring__write_name(sink->ring, RW_SRC_CUPTI, RW_NS_KERNEL, kr.name_hash,
					k->name ? k->name : "<unknown>") == 0)
			sink->stats->names++;
	} else if (added < 0) {
		sink->stats->names_full++;
	}
	rec = rw_ring__reserve(sink->ring);
	if (!rec)
		return; /* the ring counts the drop */
	rec->h.kind = RW_REC_KERNEL;
	rec->h.flags = 0;
	rec->h.src = RW_SRC_CUPTI;
	rec->h.ts = rw_now_ns();
	memset(rec->u.raw, 0, sizeof(rec->u.raw));
	rec->u.kernel = kr;
	rw_ring__commit(sink->ring, rec);
	sink->stats->written++;
}

size_t rw_cupti__parse(uint8_t *buf, size_t valid, rw_cupti_next_fn next,
		       struct rw_cupti_sink *sink)
{
	CUpti_Activity *rec = NULL;
	size_t n = 0;

	if (!buf || !valid || !sink || !sink->ring)
		return 0;
	while (next(buf, valid, &rec) == 0 && rec) {
		switch (rec->kind) {
		case CUPTI_ACTIVITY_KIND_KERNEL:
		case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
			parse__kernel((const rw_cupti_kernel *)rec, sink);
			n++;
			break;
		default:
			sink->stats->other++;
			break;
		}
	}
	return n;
}

int rw_cupti__next_packed(uint8_t *buf, size_t valid, CUpti_Activity **rec)
{
	size_t off;

	if (!*rec)
		off = 0;
	else
		off = (size_t)((uint8_t *)*rec - buf) + sizeof(rw_cupti_kernel);
	if (off > valid || valid - off < sizeof(rw_cupti_kernel)) {
		*rec = NULL;
		return 1;
	}
	*rec = (CUpti_Activity *)(buf + off);
	return 0;
}

int rw_name_set__init(struct rw_name_set *set, size_t cap)
{
	if (!cap || (cap & (cap - 1)) || cap > (1u << 26))
		return -EINVAL;
	set->slots = calloc(cap, sizeof(*set->slots));
	if (!set->slots)
		return -ENOMEM;
	set->cap = cap;
	set->used = 0;
	return 0;
}

void rw_name_set__free(struct rw_name_set *set)
{
	free(set->slots);
	set->slots = NULL;
	set->cap = set->used = 0;
}

int rw_name_set__add(struct rw_name_set *set, uint64_t hash)
{
	size_t mask = set->cap - 1, i;

	if (!hash)
		hash = 1; /* 0 marks an empty slot */
	for (i = hash & mask;; i = (i + 1) & mask) {
		if (set->slots[i] == hash)
			return 0;
		if (!set->slots[i])
			break;
	}
	if (set->used + 1 > set->cap / 4 * 3) /* keep probes short; never fill the table */
		return -ENOSPC;
	set->slots[i] = hash;
	set->used++;
	return 1;
}

int rw_buf_pool__init(struct rw_buf_pool *pool, size_t nbufs, size_t size)
{
	if (!nbufs || nbufs > 64 || size < 1024 || size % 8 || size > (SIZE_MAX / nbufs))
		return -EINVAL;
	/* CUPTI wants 8-byte aligned buffers; take a page. */
	pool->mem = aligned_alloc(4096, (nbufs * size + 4095) / 4096 * 4096);
	if (!pool->mem)
		return -ENOMEM;
	pool->nbufs = nbufs;
	pool->size = size;
	atomic_store(&pool->free_mask, nbufs == 64 ? ~0ull : (1ull << nbufs) - 1);
	atomic_store(&pool->empty, 0);
	return 0;
}

void rw_buf_pool__free(struct rw_buf_pool *pool)
{
	free(pool->mem);
	pool->mem = NULL;
	pool->nbufs = 0;
}

uint8_t *rw_buf_pool__take(struct rw_buf_pool *pool)
{
	uint64_t mask = atomic_load_explicit(&pool->free_mask, memory_order_relaxed);

	while (mask) {
		uint64_t bit = mask & -mask;

		/* Acquire pairs with the release in rw_buf_pool__give: the parser is done with it. */
		if (atomic_compare_exchange_weak_explicit(&pool->free_mask, &mask, mask & ~bit,
							  memory_order_acquire,
							  memory_order_relaxed))
			return pool->mem + (size_t)__builtin_ctzll(bit) * pool->size;
	}
	atomic_fetch_add_explicit(&pool->empty, 1, memory_order_relaxed);
	return NULL;
}

int rw_buf_pool__give(struct rw_buf_pool *pool, uint8_t *buf)
{
	size_t off;
	uint64_t bit;

	if (!pool->mem || buf < pool->mem || buf >= pool->mem + pool->nbufs * pool->size)
		return -EINVAL;
	off = (size_t)(buf - pool->mem);
	if (off % pool->size)
		return -EINVAL;
	bit = 1ull << (off / pool->size);
	/* Release pairs with the acquire CAS in rw_buf_pool__take. */
	if (atomic_fetch_or_explicit(&pool->free_mask, bit, memory_order_release) & bit)
		return -EINVAL; /* was already free */
	return 0;
}

/* Calls fn(entry, len) for each non-empty entry of a comma-separated list; stops at 1. */
static int list__any(const char *list, int (*fn)(const char *e, size_t n, const void *arg),
		     const void *arg)
{
	while (list && *list) {
		size_t n = strcspn(list, ",");

		if (n && fn(list, n, arg))
			return 1;
		list += n + (list[n] == ',');
	}
	return 0;
}

static const char *base_name(const char *path)
{
	const char *slash = strrchr(path, '/');

	return slash ? slash + 1 : path;
}

static int is_prefix(const char *e, size_t n, const void *arg)
{
	return !strncmp(base_name(arg), e, n);
}

/* A deny entry matches a token whose basename is exactly the entry, or - for entries that look
 * like module names (contain '.' or '_') - a token that contains it. */
static int deny_matches(const char *e, size_t n, const void *arg)
{
	const char *tok = arg, *base = base_name(tok);

	if (strlen(base) == n && !strncmp(base, e, n))
		return 1;
	if (memchr(e, '.', n) || memchr(e, '_', n)) {
		for (const char *p = tok; (p = strchr(p, e[0])); p++)
			if (!strncmp(p, e, n))
				return 1;
	}
	return 0;
}

int rw_cupti__selected(int argc, char *const argv[], int has_rank, const char *allow,
		       const char *deny, const char **why)
{
	*why = NULL;
	if (!has_rank) {
		*why = "neither RANK nor LOCAL_RANK is set: not a distributed worker";
		return 0;
	}
	if (argc < 1 || !argv[0]) {
		*why = "no command line";
		return 0;
	}
	if (allow && *allow && strcmp(allow, "*") && !list__any(allow, is_prefix, argv[0])) {
		*why = "the process name is not in RANKWATCH_CUPTI_ALLOW";
		return 0;
	}
	for (int i = 0; i < argc; i++) {
		if (argv[i] && list__any(deny, deny_matches, argv[i])) {
			*why = "the command line matches RANKWATCH_CUPTI_DENY (launcher, compiler)";
			return 0;
		}
	}
	return 1;
}
