// SPDX-License-Identifier: Apache-2.0
/*
 * Life cycle of the NCCL plugin's process-wide state: settings (validated environment), pools
 * allocated once at the first init, the rank's ring, the list of communicators, and the
 * snapshot thread that writes Mycroft's real-time state log (a `chunks` record per in-flight
 * proxy op every RANKWATCH_NCCL_SNAPSHOT_MS), `wr` samples per NIC and `beats`.
 *
 * Nothing here runs per event except the pool and emit helpers, which never block and never
 * allocate: a full pool or ring drops the record and counts it.
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nccl_state.h"
#include "rw_env.h"

#define RW_POOL_PROBES 32 /* slots tried before a get gives up and drops */

struct rw_nccl rw_nccl;

static pthread_mutex_t life_lock = PTHREAD_MUTEX_INITIALIZER;  /* acquire/release */
static pthread_mutex_t comms_lock = PTHREAD_MUTEX_INITIALIZER; /* comm list, beats */
static pthread_cond_t tick_cond = PTHREAD_COND_INITIALIZER;
static struct rw_comm *comms;
static int users, stopping, have_thread;
static pthread_t snap_thread;
static int64_t last_beat;

void rw_nccl__warn(const char *msg)
{
	if (rw_nccl.log)
		rw_nccl.log(NCCL_LVL_WARN, NCCL_LOG_FLAG_INIT, __FILE__, __LINE__, "rankwatch: %s",
			    msg);
	else
		rw_warn__stderr(msg);
}

static void warnf(const char *fmt, ...)
{
	char msg[512];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	rw_nccl__warn(msg);
}

static void settings__load(struct rw_settings *s)
{
	rw_warn_fn w = rw_nccl__warn;

	rw_env__long("RANKWATCH_NCCL_ENABLE", 1, 0, 1, w, &s->enable);
	rw_env__long("RANKWATCH_NCCL_RING_CAPACITY", 65536, 1024, RW_RING_MAX_CAPACITY, w,
		     &s->ring_capacity);
	if (s->ring_capacity & (s->ring_capacity - 1)) {
		warnf("RANKWATCH_NCCL_RING_CAPACITY=%ld is not a power of two; using 65536",
		      s->ring_capacity);
		s->ring_capacity = 65536;
	}
	rw_env__long("RANKWATCH_NCCL_OP_POOL", 4096, 16, 1 << 20, w, &s->op_pool);
	rw_env__long("RANKWATCH_NCCL_FLOW_POOL", 8192, 16, 1 << 20, w, &s->flow_pool);
	rw_env__long("RANKWATCH_NCCL_WR_POOL", 8192, 16, 1 << 20, w, &s->wr_pool);
	rw_env__long("RANKWATCH_NCCL_SNAPSHOT_MS", 100, 0, 60000, w, &s->snapshot_ms);
	rw_env__long("RANKWATCH_NCCL_BEAT_MS", 1000, 100, 600000, w, &s->beat_ms);
	rw_env__long("RANKWATCH_NCCL_KERNEL_CH_WAIT", -1, -1, 1, w, &s->kch_wait);
	rw_env__long("RANK", -1, 0, 0x7fffffff, w, &s->rank);
	rw_env__str("RANKWATCH_RING_PREFIX", "/rankwatch", s->prefix, sizeof(s->prefix), w);
	rw_env__job_id(s->job_id, sizeof(s->job_id), w);
}

static int pool__init(struct rw_pool *pool, size_t n, size_t stride, uint8_t tag)
{
	pool->base = calloc(n, stride);
	if (!pool->base)
		return -ENOMEM;
	pool->size = n;
	pool->stride = stride;
	atomic_store(&pool->cursor, 0);
	for (size_t i = 0; i < n; i++)
		((struct rw_obj *)(pool->base + i * stride))->tag = tag;
	return 0;
}

void *rw_pool__get(struct rw_pool *pool)
{
	for (int i = 0; i < RW_POOL_PROBES; i++) {
		uint64_t idx = atomic_fetch_add_explicit(&pool->cursor, 1, memory_order_relaxed);
		struct rw_obj *obj = (struct rw_obj *)(pool->base + (idx % pool->size) * pool->stride);
		uint8_t expect = RW_SLOT_FREE;

		/* Acquire pairs with the release stores of FREE in rw_pool__put and the snapshot
		 * thread's unpin: the previous user's accesses are done. */
		if (atomic_compare_exchange_strong_explicit(&obj->state, &expect, RW_SLOT_INIT,
							    memory_order_acquire,
							    memory_order_relaxed))
			return obj;
	}
	atomic_fetch_add_explicit(&rw_nccl.pool_drops, 1, memory_order_relaxed);
	return NULL;
}

void rw_pool__publish(void *p)
{
	/* Pairs with the acquire CAS BUSY -> PINNED in rw_nccl__snapshot: the identity fields
	 * written before this store are what the snapshot thread reads. */
	atomic_store_explicit(&((struct rw_obj *)p)->state, RW_SLOT_BUSY, memory_order_release);
}

void rw_pool__put(struct rw_pool *pool, void *p)
{
	struct rw_obj *obj = p;
	uint8_t expect = RW_SLOT_BUSY;

	(void)pool;
	for (;;) {
		/* Release pairs with the acquire CAS in rw_pool__get. */
		if (atomic_compare_exchange_weak_explicit(&obj->state, &expect, RW_SLOT_FREE,
							  memory_order_release,
							  memory_order_relaxed))
			return;
		if (expect == RW_SLOT_PINNED &&
		    atomic_compare_exchange_weak_explicit(&obj->state, &expect, RW_SLOT_ZOMBIE,
							  memory_order_relaxed,
							  memory_order_relaxed))
			return; /* the snapshot thread frees it when done reading */
		if (expect != RW_SLOT_BUSY && expect != RW_SLOT_PINNED)
			return; /* not live: a double stop, ignore */
	}
}

int rw_pool__owns(const struct rw_pool *pool, const void *p)
{
	const char *c = p;

	if (!pool->base || c < pool->base || c >= pool->base + pool->size * pool->stride)
		return 0;
	return (size_t)(c - pool->base) % pool->stride == 0;
}

struct rw_record *rw_nccl__reserve(uint16_t kind, uint16_t flags)
{
	struct rw_record *rec;

	if (!rw_nccl.ring) {
		atomic_fetch_add_explicit(&rw_nccl.no_ring, 1, memory_order_relaxed);
		return NULL;
	}
	rec = rw_ring__reserve(rw_nccl.ring); /* a full ring counts the drop itself */
	if (!rec)
		return NULL;
	memset(rec->u.raw, 0, sizeof(rec->u.raw));
	rec->h.kind = kind;
	rec->h.flags = flags;
	rec->h.src = RW_SRC_NCCL;
	rec->h.ts = rw_now_ns();
	return rec;
}

void rw_nccl__commit(struct rw_record *rec)
{
	rw_ring__commit(rw_nccl.ring, rec);
}

void rw_nccl__emit_name(uint16_t ns, uint64_t hash, const char *text)
{
	if (!rw_nccl.ring)
		atomic_fetch_add_explicit(&rw_nccl.no_ring, 1, memory_order_relaxed);
	else
		rw_ring__write_name(rw_nccl.ring, RW_SRC_NCCL, ns, hash, text);
}

void rw_nccl__op_emit(struct rw_op *op, int end)
{
	struct rw_record *rec = rw_nccl__reserve(RW_REC_OP, end ? RW_F_END : 0);

	if (!rec)
		return;
	rec->u.op = op->rec;
	rec->u.op.t_start = atomic_load_explicit(&op->t_start, memory_order_relaxed);
	rec->u.op.t_end = end ? atomic_load_explicit(&op->t_end, memory_order_relaxed) : 0;
	rec->u.op.nchildren = atomic_load_explicit(&op->nchildren, memory_order_relaxed);
	rw_nccl__commit(rec);
}

void rw_nccl__op_unref(struct rw_op *op)
{
	/* acq_rel: the thread that drops the last reference sees every child's t_end update. */
	if (atomic_fetch_sub_explicit(&op->refs, 1, memory_order_acq_rel) != 1)
		return;
	if (!atomic_load_explicit(&op->t_end, memory_order_relaxed))
		atomic_store_explicit(&op->t_end, rw_now_ns(), memory_order_relaxed);
	rw_nccl__op_emit(op, 1);
	atomic_store_explicit(&op->comm->last_op_seq, (int64_t)op->rec.op_seq,
			      memory_order_relaxed);
	rw_pool__put(&rw_nccl.ops, op);
}

void rw_nccl__flow_emit(struct rw_flow *f, int64_t t_end)
{
	struct rw_record *rec = rw_nccl__reserve(RW_REC_FLOW,
						 RW_F_END | (f->detached ? RW_F_DETACHED : 0));
	uint64_t bytes = atomic_load_explicit(&f->bytes, memory_order_relaxed);

	if (!rec)
		return;
	rec->u.flow.comm_hash = f->comm_hash;
	rec->u.flow.op_seq = f->op_seq;
	rec->u.flow.t_start = f->t_start;
	rec->u.flow.t_end = t_end;
	rec->u.flow.peer = f->peer;
	rec->u.flow.channel = f->channel;
	rec->u.flow.is_send = f->is_send;
	rec->u.flow.nsteps = f->nsteps;
	rec->u.flow.chunk_size = f->chunk_size;
	rec->u.flow.gpu_ready = atomic_load_explicit(&f->gpu_ready, memory_order_relaxed);
	rec->u.flow.rdma_transmitted = atomic_load_explicit(&f->rdma_transmitted,
							    memory_order_relaxed);
	rec->u.flow.rdma_done = atomic_load_explicit(&f->rdma_done, memory_order_relaxed);
	rec->u.flow.bytes = bytes ? bytes : (uint64_t)rec->u.flow.rdma_done * f->chunk_size;
	rw_nccl__commit(rec);
}

/* Copy a live flow's snapshot fields, or return 0 if the slot is not live. */
static int flow__pin_copy(struct rw_flow *f, struct rw_rec_chunk *c, uint64_t *key, int *det)
{
	uint8_t expect = RW_SLOT_BUSY;

	if (atomic_load_explicit(&f->obj.state, memory_order_relaxed) != RW_SLOT_BUSY)
		return 0;
	/* Acquire pairs with the release in rw_pool__publish. */
	if (!atomic_compare_exchange_strong_explicit(&f->obj.state, &expect, RW_SLOT_PINNED,
						     memory_order_acquire, memory_order_relaxed))
		return 0;
	c->comm_hash = f->comm_hash;
	c->op_seq = f->op_seq;
	c->channel = f->channel;
	c->is_send = f->is_send;
	c->peer = f->peer;
	c->total_chunks = f->nsteps;
	c->gpu_ready = atomic_load_explicit(&f->gpu_ready, memory_order_relaxed);
	c->rdma_transmitted = atomic_load_explicit(&f->rdma_transmitted, memory_order_relaxed);
	c->rdma_done = atomic_load_explicit(&f->rdma_done, memory_order_relaxed);
	*key = f->op_seq * 1000003u ^ (uint64_t)f->t_start;
	*det = f->detached;
	expect = RW_SLOT_PINNED;
	/* Release pairs with the acquire CAS in rw_pool__get (after a ZOMBIE is freed here). */
	if (!atomic_compare_exchange_strong_explicit(&f->obj.state, &expect, RW_SLOT_BUSY,
						     memory_order_release, memory_order_relaxed))
		atomic_store_explicit(&f->obj.state, RW_SLOT_FREE, memory_order_release);
	return 1;
}

static void snapshot__beats(int64_t now)
{
	struct rw_ring_stat st = { 0 };
	uint64_t pool = atomic_load_explicit(&rw_nccl.pool_drops, memory_order_relaxed);

	if (last_beat && now - last_beat < rw_nccl.set.beat_ms * 1000000ll)
		return;
	last_beat = now;
	if (rw_nccl.ring)
		rw_ring__stat(rw_nccl.ring, &st);
	pthread_mutex_lock(&comms_lock);
	for (struct rw_comm *c = comms; c; c = c->next) {
		struct rw_record *rec = rw_nccl__reserve(RW_REC_BEAT, 0);

		if (!rec)
			break;
		rec->u.beat.comm_hash = c->hash;
		rec->u.beat.last_op_seq = atomic_load_explicit(&c->last_op_seq,
							       memory_order_relaxed);
		rec->u.beat.dropped = st.drops + pool;
		rec->u.beat.pool_dropped = pool;
		rw_nccl__commit(rec);
	}
	pthread_mutex_unlock(&comms_lock);
}

void rw_nccl__snapshot(int64_t now)
{
	for (size_t i = 0; i < rw_nccl.flows.size; i++) {
		struct rw_flow *f = (struct rw_flow *)(rw_nccl.flows.base + i * rw_nccl.flows.stride);
		struct rw_rec_chunk c;
		uint64_t key;
		int det;

		if (!flow__pin_copy(f, &c, &key, &det))
			continue;
		uint16_t flags = det ? RW_F_DETACHED : 0;
		if (f->snap_key == key && f->snap_seen[0] == c.gpu_ready &&
		    f->snap_seen[1] == c.rdma_transmitted && f->snap_seen[2] == c.rdma_done)
			flags |= RW_F_STALLED;
		f->snap_key = key;
		f->snap_seen[0] = c.gpu_ready;
		f->snap_seen[1] = c.rdma_transmitted;
		f->snap_seen[2] = c.rdma_done;
		struct rw_record *rec = rw_nccl__reserve(RW_REC_CHUNK, flags);
		if (!rec)
			continue;
		rec->u.chunk = c;
		rec->h.ts = now;
		rw_nccl__commit(rec);
	}
	for (int d = 0; d < RW_MAX_NICS; d++) {
		struct rw_nic *nic = &rw_nccl.nics[d];
		uint64_t posted = atomic_load_explicit(&nic->posted, memory_order_relaxed);
		uint64_t done = atomic_load_explicit(&nic->completed, memory_order_relaxed);
		char name[32];

		if (!posted)
			continue;
		snprintf(name, sizeof(name), "netdev%d", d);
		uint64_t hash = rw_hash__str(name, sizeof(name));
		if (!atomic_exchange_explicit(&nic->named, 1, memory_order_relaxed))
			rw_nccl__emit_name(RW_NS_NIC, hash, name);
		struct rw_record *rec = rw_nccl__reserve(RW_REC_WR, 0);
		if (!rec)
			continue;
		rec->u.wr.nic_hash = hash;
		rec->u.wr.device = d;
		rec->u.wr.posted = posted;
		rec->u.wr.completed = done;
		rec->u.wr.inflight = posted > done ? posted - done : 0;
		rec->u.wr.bytes_done = atomic_load_explicit(&nic->bytes_done, memory_order_relaxed);
		rec->h.ts = now;
		rw_nccl__commit(rec);
	}
	snapshot__beats(now);
}

static void *snapshot__main(void *arg)
{
	struct timespec next;

	(void)arg;
	clock_gettime(CLOCK_MONOTONIC, &next);
	pthread_mutex_lock(&comms_lock);
	while (!stopping) {
		next.tv_nsec += rw_nccl.set.snapshot_ms * 1000000l;
		next.tv_sec += next.tv_nsec / 1000000000l;
		next.tv_nsec %= 1000000000l;
		while (!stopping && pthread_cond_timedwait(&tick_cond, &comms_lock, &next) != ETIMEDOUT)
			;
		if (stopping)
			break;
		pthread_mutex_unlock(&comms_lock);
		rw_nccl__snapshot(rw_now_ns());
		pthread_mutex_lock(&comms_lock);
	}
	pthread_mutex_unlock(&comms_lock);
	return NULL;
}

static int state__start(int comm_rank, nccl_logger_t log)
{
	struct rw_ring_opts opts = { 0 };
	char name[256];
	int err, rank;

	memset(&rw_nccl, 0, sizeof(rw_nccl));
	rw_nccl.log = log; /* warnings about settings go to NCCL's log */
	settings__load(&rw_nccl.set);
	rw_nccl.pid = (int)getpid();
	if (!rw_nccl.set.enable)
		return 0;
	err = pool__init(&rw_nccl.ops, (size_t)rw_nccl.set.op_pool, sizeof(struct rw_op),
			 RW_OBJ_OP);
	err = err ?: pool__init(&rw_nccl.flows, (size_t)rw_nccl.set.flow_pool,
				sizeof(struct rw_flow), RW_OBJ_FLOW);
	err = err ?: pool__init(&rw_nccl.wrs, (size_t)rw_nccl.set.wr_pool, sizeof(struct rw_wr),
				RW_OBJ_WR);
	if (err)
		goto cleanup;
	rank = rw_nccl.set.rank >= 0 ? (int)rw_nccl.set.rank : comm_rank;
	opts = (struct rw_ring_opts){ .capacity = (uint64_t)rw_nccl.set.ring_capacity,
				      .rank = rank, .source = RW_SRC_NCCL,
				      .job_id = rw_nccl.set.job_id };
	err = rw_ring__name(name, sizeof(name), rw_nccl.set.prefix, rw_nccl.set.job_id, rank,
			    "nccl");
	err = err ?: rw_ring__create(name, &opts, &rw_nccl.ring);
	if (err) /* run without a ring: events are counted, records are lost */
		warnf("cannot create ring %s: %s; records will be dropped", name, strerror(-err));
	stopping = 0;
	last_beat = 0;
	if (rw_nccl.set.snapshot_ms > 0) {
		/* The thread sleeps until an absolute CLOCK_MONOTONIC deadline, so the condition
		 * variable must time out on that clock: with the default (CLOCK_REALTIME) every
		 * deadline lies decades in the past and the thread would spin, flooding the ring
		 * with snapshots (seen on a real NCCL job: ~100,000 chunk records per second). */
		pthread_condattr_t attr;

		pthread_condattr_init(&attr);
		pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
		pthread_cond_destroy(&tick_cond);
		pthread_cond_init(&tick_cond, &attr);
		pthread_condattr_destroy(&attr);
		have_thread = !pthread_create(&snap_thread, NULL, snapshot__main, NULL);
		if (!have_thread)
			warnf("cannot start the snapshot thread; no chunk snapshots");
	}
	return 0;
cleanup:
	free(rw_nccl.ops.base);
	free(rw_nccl.flows.base);
	free(rw_nccl.wrs.base);
	memset(&rw_nccl, 0, sizeof(rw_nccl));
	return err;
}

static void state__stop(void)
{
	if (have_thread) {
		pthread_mutex_lock(&comms_lock);
		stopping = 1;
		pthread_cond_signal(&tick_cond);
		pthread_mutex_unlock(&comms_lock);
		pthread_join(snap_thread, NULL);
		have_thread = 0;
	}
	if (rw_nccl.set.enable) {
		last_beat = 0; /* a final beat carries the final drop counts */
		rw_nccl__snapshot(rw_now_ns());
	}
	rw_ring__free(rw_nccl.ring); /* the name stays: the agent drains what is left */
	free(rw_nccl.ops.base);
	free(rw_nccl.flows.base);
	free(rw_nccl.wrs.base);
	memset(&rw_nccl, 0, sizeof(rw_nccl));
}

int rw_nccl__acquire(const char *comm_name, uint64_t comm_hash, int nnodes, int nranks,
		     int comm_rank, nccl_logger_t log, struct rw_comm **out)
{
	struct rw_comm *comm = NULL;
	struct rw_record *rec;
	char text[64];
	int err = 0;

	pthread_mutex_lock(&life_lock);
	if (!users) {
		err = state__start(comm_rank, log);
		if (err)
			goto cleanup;
	}
	rw_nccl.log = log;
	comm = calloc(1, sizeof(*comm)); /* once per communicator, not per event */
	if (!comm) {
		err = -ENOMEM;
		goto cleanup;
	}
	users++;
	comm->hash = comm_hash;
	comm->nranks = nranks;
	comm->comm_rank = comm_rank;
	comm->nnodes = nnodes;
	atomic_store(&comm->last_op_seq, -1);
	if (rw_nccl.set.enable) {
		if (!comm_name || !*comm_name) {
			snprintf(text, sizeof(text), "comm-%016llx", (unsigned long long)comm_hash);
			comm_name = text;
		}
		rw_nccl__emit_name(RW_NS_COMM, comm_hash, comm_name);
		rec = rw_nccl__reserve(RW_REC_COMM, 0);
		if (rec) {
			rec->u.comm = (struct rw_rec_comm){ .comm_hash = comm_hash, .nranks = nranks,
							    .comm_rank = comm_rank, .nnodes = nnodes,
							    .rank = (int32_t)rw_nccl.set.rank };
			rw_nccl__commit(rec);
		}
	}
	pthread_mutex_lock(&comms_lock);
	comm->next = comms;
	comms = comm;
	pthread_mutex_unlock(&comms_lock);
	*out = comm;
cleanup:
	if (err && !users)
		state__stop();
	pthread_mutex_unlock(&life_lock);
	return err;
}

void rw_nccl__release(struct rw_comm *comm)
{
	pthread_mutex_lock(&life_lock);
	pthread_mutex_lock(&comms_lock);
	for (struct rw_comm **p = &comms; *p; p = &(*p)->next) {
		if (*p == comm) {
			*p = comm->next;
			break;
		}
	}
	pthread_mutex_unlock(&comms_lock);
	if (users > 0 && --users == 0) {
		/* Beat once more for this communicator before it goes. */
		comm->next = NULL;
		pthread_mutex_lock(&comms_lock);
		comms = comm;
		pthread_mutex_unlock(&comms_lock);
		state__stop();
		comms = NULL;
	}
	free(comm);
	pthread_mutex_unlock(&life_lock);
}
