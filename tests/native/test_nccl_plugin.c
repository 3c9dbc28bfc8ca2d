// SPDX-License-Identifier: Apache-2.0
/*
 * Drives librankwatch_nccl.so the way NCCL does, without NCCL or a GPU: dlopen, look up the
 * versioned tables, init a communicator, then the event sequence of a ring AllReduce over four
 * channels (op start and its enqueue-time stop, kernel channels, send/recv proxy ops, proxy
 * step state transitions, IB work requests), with the send on channel 2 stalled mid-transfer.
 * Checks the ring's records: ops, flows, chunk snapshots (counters, stalled flag), wr samples,
 * beats, names; then pools full (drops counted, detached flows), a bad environment value, and
 * the snapshot thread running against a busy proxy thread (for ThreadSanitizer).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nccl_profiler_api.h"
#include "rw_ring.h"
#include "rw_test.h"

#define NCH 4
#define NSTEPS 8
#define CHUNK (128 * 1024)
#define STALLED_CH 2
#define MAX_RECS (1 << 20)

static const struct nccl_profiler_v5 *v5;
static const struct nccl_profiler_v4 *v4;
static void (*snapshot_now)(void);
static void (*counters)(uint64_t out[3]);
static int warnings;
static struct rw_record *recs;
static long nrecs;

static void logger(int level, unsigned long flags, const char *file, int line,
		   const char *fmt, ...)
{
	va_list ap;

	(void)flags;
	(void)file;
	(void)line;
	if (level == NCCL_LVL_WARN)
		warnings++;
	va_start(ap, fmt);
	fprintf(stderr, "  [plugin log] ");
	vfprintf(stderr, fmt, ap);
	fprintf(stderr, "\n");
	va_end(ap);
}

static void *start(void *ctx, uint64_t type, void *parent, union nccl_ev_body body)
{
	struct nccl_ev_descr_v5 d = { .type = type, .parent = parent, .rank = 0, .u = body };
	void *h = (void *)1;

	CHECK_EQ(v5->start_event(ctx, &h, &d), NCCL_OK);
	return h;
}

static void state(void *h, int st, size_t trans)
{
	union nccl_ev_state_args a = { .proxy_step = { .trans_size = trans } };

	CHECK_EQ(v5->record_event_state(h, st, &a), NCCL_OK);
}

static void stop(void *h)
{
	CHECK_EQ(v5->stop_event(h), NCCL_OK);
}

static void *proxy_op(void *ctx, void *op, int ch, int peer, int is_send)
{
	union nccl_ev_body b = { .proxy_op = { .pid = getpid(), .channel_id = (uint8_t)ch,
					       .peer = peer, .n_steps = NSTEPS,
					       .chunk_size = CHUNK, .is_send = is_send } };
	return start(ctx, NCCL_EV_PROXY_OP, op, b);
}

/* One send step through its states; returns the open work request if `complete` is 0. */
static void *send_step(void *ctx, void *flow, int step, int complete)
{
	union nccl_ev_body b = { .proxy_step = { .step = step } };
	void *s = start(ctx, NCCL_EV_PROXY_STEP, flow, b);
	struct nccl_net_ib_event_v1 ib = { .type = NCCL_NET_IB_EV_QP,
					   .qp = { .device = 0, .length = CHUNK } };
	union nccl_ev_body nb = { .net_plugin = { .id = NCCL_NET_EV_TYPE_IB | 1, .data = &ib } };

	CHECK(s != NULL);
	state(s, NCCL_ST_STEP_SEND_GPU_WAIT, 0);
	state(s, NCCL_ST_STEP_SEND_PEER_WAIT, 0);
	state(s, NCCL_ST_STEP_SEND_WAIT, CHUNK);
	void *wr = start(ctx, NCCL_EV_NET_PLUGIN, s, nb);
	CHECK(wr != NULL);
	if (!complete)
		return s;
	stop(wr);
	stop(s);
	return NULL;
}

static void recv_step(void *ctx, void *flow, int step)
{
	union nccl_ev_body b = { .proxy_step = { .step = step } };
	void *s = start(ctx, NCCL_EV_PROXY_STEP, flow, b);

	state(s, NCCL_ST_STEP_RECV_WAIT, 0);
	state(s, NCCL_ST_STEP_RECV_FLUSH_WAIT, CHUNK);
	state(s, NCCL_ST_STEP_RECV_GPU_WAIT, 0);
	stop(s);
}

static void drain(struct rw_ring *r)
{
	long n = rw_ring__drain(r, recs + nrecs, (size_t)(MAX_RECS - nrecs), 0);

	CHECK(n >= 0);
	nrecs += n;
}

static int count(uint16_t kind, uint16_t flags_set)
{
	int n = 0;

	for (long i = 0; i < nrecs; i++)
		n += recs[i].h.kind == kind && (recs[i].h.flags & flags_set) == flags_set;
	return n;
}

static const struct rw_record *last_of(uint16_t kind)
{
	for (long i = nrecs - 1; i >= 0; i--)
		if (recs[i].h.kind == kind)
			return &recs[i];
	return NULL;
}

static const struct rw_rec_name *name_of(uint64_t hash)
{
	for (long i = 0; i < nrecs; i++)
		if (recs[i].h.kind == RW_REC_NAME && recs[i].u.name.hash == hash)
			return &recs[i].u.name;
	return NULL;
}

static struct rw_ring *attach(const char *job)
{
	char name[256];
	struct rw_ring *r;

	CHECK_EQ(rw_ring__name(name, sizeof(name), getenv("RANKWATCH_RING_PREFIX"), job, 0,
			       "nccl"), 0);
	CHECK_EQ(rw_ring__attach(name, &r), 0);
	nrecs = 0;
	return r;
}

static void test_ring_allreduce_with_stall(void)
{
	union nccl_ev_body coll = { .coll = { .seq_number = 17, .func = "AllReduce",
					      .count = 1 << 20, .datatype = "ncclFloat32",
					      .n_channels = NCH, .n_warps = 16, .algo = "Ring",
					      .proto = "Simple", .root = 0 } };
	void *ctx = NULL, *sends[NCH], *open_step, *kch[NCH];
	int mask = 0;

	setenv("RANKWATCH_JOB_ID", "allreduce", 1);
	setenv("RANKWATCH_NCCL_KERNEL_CH_WAIT", "1", 1);
	CHECK_EQ(v5->init(&ctx, 0x1234, &mask, "dp:pp0:tp0", 2, 4, 0, logger), NCCL_OK);
	CHECK(ctx != NULL);
	CHECK(mask & NCCL_EV_PROXY_STEP);
	CHECK(!(mask & NCCL_EV_PROXY_CTRL));
	struct rw_ring *r = attach("allreduce");

	void *op = start(ctx, NCCL_EV_COLL, NULL, coll);
	CHECK(op != NULL);
	stop(op); /* NCCL stops the op once it is enqueued, long before it completes */
	for (int ch = 0; ch < NCH; ch++) {
		union nccl_ev_body k = { .kernel_ch = { .channel_id = (uint8_t)ch } };

		kch[ch] = start(ctx, NCCL_EV_KERNEL_CH, op, k);
		CHECK(kch[ch] != NULL);
		sends[ch] = proxy_op(ctx, op, ch, 1, 1);
		void *recv = proxy_op(ctx, op, ch, 3, 0);
		CHECK(sends[ch] && recv);
		for (int s = 0; s < NSTEPS; s++)
			recv_step(ctx, recv, s);
		stop(recv);
		if (ch == STALLED_CH)
			continue;
		for (int s = 0; s < NSTEPS; s++)
			send_step(ctx, sends[ch], s, 1);
		stop(sends[ch]);
		stop(kch[ch]);
	}
	/* Channel 2: four steps done, the fifth posted and never completed. */
	for (int s = 0; s < 4; s++)
		send_step(ctx, sends[STALLED_CH], s, 1);
	open_step = send_step(ctx, sends[STALLED_CH], 4, 0);

	snapshot_now();
	snapshot_now();
	drain(r);
	CHECK_EQ(count(RW_REC_OP, 0), 1); /* the start record only: the op is in flight */
	CHECK_EQ(last_of(RW_REC_OP)->u.op.t_end, 0);
	CHECK_EQ(count(RW_REC_FLOW, RW_F_END), 2 * NCH - 1);
	CHECK_EQ(count(RW_REC_CHUNK, 0), 2);
	CHECK_EQ(count(RW_REC_CHUNK, RW_F_STALLED), 1);
	const struct rw_rec_chunk *c = &last_of(RW_REC_CHUNK)->u.chunk;
	CHECK_EQ(c->comm_hash, 0x1234);
	CHECK_EQ(c->op_seq, 0);
	CHECK_EQ(c->channel, STALLED_CH);
	CHECK_EQ(c->is_send, 1);
	CHECK_EQ(c->peer, 1);
	CHECK_EQ(c->total_chunks, NSTEPS);
	CHECK_EQ(c->gpu_ready, 5);
	CHECK_EQ(c->rdma_transmitted, 5);
	CHECK_EQ(c->rdma_done, 4);
	const struct rw_rec_wr *w = &last_of(RW_REC_WR)->u.wr;
	const struct rw_rec_name *nm;
	CHECK_EQ(w->posted, NSTEPS * (NCH - 1) + 5);
	CHECK_EQ(w->inflight, 1);
	CHECK_EQ(w->bytes_done, (uint64_t)CHUNK * (NSTEPS * (NCH - 1) + 4));
	nm = name_of(w->nic_hash);
	CHECK(nm && nm->ns == RW_NS_NIC && memcmp(nm->text, "netdev0", 7) == 0);
	CHECK_EQ(count(RW_REC_BEAT, 0), 1);
	CHECK_EQ(last_of(RW_REC_BEAT)->u.beat.last_op_seq, -1);
	CHECK_EQ(count(RW_REC_COMM, 0), 1);
	CHECK_EQ(last_of(RW_REC_COMM)->u.comm.nranks, 4);
	nm = name_of(0x1234);
	CHECK(nm && nm->ns == RW_NS_COMM && nm->nparts == 1);
	CHECK(memcmp(nm->text, "dp:pp0:tp0", nm->len) == 0 && nm->len == 10);

	/* The transfer resumes: the op ends once every child stopped. */
	stop(open_step); /* the step's work request was left open with it; close both */
	for (int s = 5; s < NSTEPS; s++)
		send_step(ctx, sends[STALLED_CH], s, 1);
	stop(sends[STALLED_CH]);
	stop(kch[STALLED_CH]);
	drain(r);
	CHECK_EQ(count(RW_REC_OP, RW_F_END), 1);
	const struct rw_rec_op *o = &last_of(RW_REC_OP)->u.op;
	CHECK_EQ(o->op_seq, 0);
	CHECK_EQ(o->nccl_seq, 17);
	CHECK_EQ(o->func, RW_FUNC_ALLREDUCE);
	CHECK_EQ(o->algo, RW_ALGO_RING);
	CHECK_EQ(o->proto, RW_PROTO_SIMPLE);
	CHECK_EQ(o->datatype, 4);
	CHECK_EQ(o->bytes, 4u << 20);
	CHECK_EQ(o->nchannels, NCH);
	CHECK_EQ(o->peer, -1);
	CHECK_EQ(o->nchildren, 3 * NCH);
	CHECK(o->t_enqueue > 0 && o->t_start >= o->t_enqueue && o->t_end >= o->t_start);
	CHECK_EQ(count(RW_REC_FLOW, RW_F_END), 2 * NCH);
	const struct rw_rec_flow *f = &last_of(RW_REC_FLOW)->u.flow;
	CHECK(f->channel == STALLED_CH && f->is_send && f->nsteps == NSTEPS);
	CHECK(f->gpu_ready == NSTEPS && f->rdma_transmitted == NSTEPS && f->rdma_done == NSTEPS);
	CHECK_EQ(f->bytes, (uint64_t)NSTEPS * CHUNK);
	CHECK_EQ(f->chunk_size, CHUNK);
	for (long i = 0; i < nrecs; i++) /* receive flows count the same steps */
		if (recs[i].h.kind == RW_REC_FLOW && !recs[i].u.flow.is_send)
			CHECK(recs[i].u.flow.rdma_transmitted == NSTEPS &&
			      recs[i].u.flow.rdma_done == NSTEPS &&
			      recs[i].u.flow.gpu_ready == NSTEPS && recs[i].u.flow.peer == 3);

	/* A p2p Send: the communicator's op_seq moves on. */
	union nccl_ev_body p2p = { .p2p = { .func = "Send", .count = 256, .datatype = "ncclInt8",
					    .peer = 2, .n_channels = 1 } };
	void *sop = start(ctx, NCCL_EV_P2P, NULL, p2p);
	union nccl_ev_body k0 = { .kernel_ch = { .channel_id = 0 } };
	void *kc = start(ctx, NCCL_EV_KERNEL_CH, sop, k0);
	stop(sop);
	stop(kc);
	uint64_t cnt[3];
	CHECK_EQ(v5->stop_event((void *)cnt), NCCL_OK); /* a stray handle: ignored, counted */
	counters(cnt);
	CHECK_EQ(cnt[0], 0);
	CHECK_EQ(cnt[1], 1);
	CHECK_EQ(v5->finalize(ctx), NCCL_OK);
	drain(r);
	o = &last_of(RW_REC_OP)->u.op;
	CHECK(o->op_seq == 1 && o->func == RW_FUNC_SEND && o->peer == 2 && o->bytes == 256);
	CHECK_EQ(last_of(RW_REC_BEAT)->u.beat.last_op_seq, 1); /* the final beat */
	CHECK_EQ(last_of(RW_REC_BEAT)->u.beat.dropped, 0);
	unsetenv("RANKWATCH_NCCL_KERNEL_CH_WAIT");
	rw_ring__free(r);
}

static void test_full_pools_v4(void)
{
	union nccl_ev_body coll = { .coll = { .func = "AllGather", .count = 8,
					      .datatype = "ncclBfloat16", .n_channels = 1 } };
	void *ctx = NULL, *ops[40], *flows[20];
	int mask = 0, live = 0, nflows = 0;
	uint64_t cnt[3];

	setenv("RANKWATCH_JOB_ID", "pools", 1);
	setenv("RANKWATCH_NCCL_OP_POOL", "16", 1);
	setenv("RANKWATCH_NCCL_FLOW_POOL", "16", 1);
	setenv("RANKWATCH_NCCL_BEAT_MS", "5ms", 1); /* not a number: warned, default used */
	warnings = 0;
	CHECK_EQ(v4->init(&ctx, &mask, NULL, 0xbeef, 1, 2, 0, logger), NCCL_OK);
	CHECK_EQ(warnings, 1);
	struct rw_ring *r = attach("pools");
	for (int i = 0; i < 40; i++) {
		struct nccl_ev_descr_v4 d = { .type = NCCL_EV_COLL, .u = coll };

		CHECK_EQ(v4->start_event(ctx, &ops[i], &d), NCCL_OK);
		live += ops[i] != NULL;
	}
	CHECK_EQ(live, 16);
	for (int i = 0; i < 20; i++) { /* parent NULL: NCCL passes what start gave it */
		struct nccl_ev_descr_v4 d = { .type = NCCL_EV_PROXY_OP,
					      .u.proxy_op = { .pid = getpid(), .n_steps = 1 } };

		CHECK_EQ(v4->start_event(ctx, &flows[i], &d), NCCL_OK);
		nflows += flows[i] != NULL;
	}
	CHECK_EQ(nflows, 16);
	counters(cnt);
	CHECK_EQ(cnt[0], 24 + 4);
	for (int i = 0; i < 20; i++)
		CHECK_EQ(v4->stop_event(flows[i]), NCCL_OK); /* NULL handles are fine */
	for (int i = 0; i < 40; i++)
		CHECK_EQ(v4->stop_event(ops[i]), NCCL_OK);
	CHECK_EQ(v4->finalize(ctx), NCCL_OK);
	drain(r);
	CHECK_EQ(count(RW_REC_OP, 0), 32); /* 16 starts + 16 ends */
	CHECK_EQ(count(RW_REC_FLOW, RW_F_DETACHED), 16);
	CHECK_EQ(last_of(RW_REC_FLOW)->u.flow.op_seq, UINT64_MAX);
	CHECK_EQ(last_of(RW_REC_BEAT)->u.beat.pool_dropped, 28);
	const struct rw_rec_name *nm = name_of(0xbeef);
	CHECK(nm && memcmp(nm->text, "comm-000000000000beef", nm->len) == 0);
	unsetenv("RANKWATCH_NCCL_OP_POOL");
	unsetenv("RANKWATCH_NCCL_FLOW_POOL");
	unsetenv("RANKWATCH_NCCL_BEAT_MS");
	rw_ring__free(r);
}

struct worker {
	void *ctx;
	int cycles;
};

static void *busy_proxy(void *arg)
{
	struct worker *w = arg;

	for (int i = 0; i < w->cycles; i++) {
		void *f = proxy_op(w->ctx, NULL, i % 32, 1, 1);

		if (!f)
			continue;
		send_step(w->ctx, f, 0, 1);
		stop(f);
	}
	return NULL;
}

/* Two proxy threads start and stop flows while the snapshot thread pins them every ms. */
static void test_snapshot_thread_concurrency(void)
{
	struct worker w[2];
	pthread_t t[2];
	int mask;

	setenv("RANKWATCH_JOB_ID", "threads", 1);
	setenv("RANKWATCH_NCCL_SNAPSHOT_MS", "1", 1);
	setenv("RANKWATCH_NCCL_RING_CAPACITY", "1048576", 1);
	CHECK_EQ(v5->init(&w[0].ctx, 1, &mask, "a", 1, 2, 0, logger), NCCL_OK);
	CHECK_EQ(v5->init(&w[1].ctx, 2, &mask, "b", 1, 2, 0, logger), NCCL_OK);
	struct rw_ring *r = attach("threads");
	for (int i = 0; i < 2; i++) {
		w[i].cycles = 20000;
		CHECK_EQ(pthread_create(&t[i], NULL, busy_proxy, &w[i]), 0);
	}
	for (int i = 0; i < 2; i++)
		pthread_join(t[i], NULL);
	struct timespec ms5 = { 0, 5000000 };
	nanosleep(&ms5, NULL);
	CHECK_EQ(v5->finalize(w[0].ctx), NCCL_OK);
	CHECK_EQ(v5->finalize(w[1].ctx), NCCL_OK);
	drain(r);
	uint64_t cnt[3];
	counters(cnt); /* after finalize the state is reset; only the ring tells */
	int flows = count(RW_REC_FLOW, RW_F_END);
	struct rw_ring_stat st;
	CHECK_EQ(rw_ring__stat(r, &st), 0);
	CHECK_EQ(st.drops, 0);
	CHECK_EQ(flows + (int)last_of(RW_REC_BEAT)->u.beat.pool_dropped, 40000);
	printf("  %d flows, %d chunk snapshots while busy\n", flows, count(RW_REC_CHUNK, 0));
	unsetenv("RANKWATCH_NCCL_SNAPSHOT_MS");
	rw_ring__free(r);
}

/* The snapshot thread keeps its period: one in-flight flow held for ~400 ms with a 50 ms period
 * gives about 8 snapshots, not one per loop of a spinning thread (the thread waits on a
 * CLOCK_MONOTONIC deadline; a condition variable on the default clock returned at once). */
static void test_snapshot_period(void)
{
	void *ctx;
	int mask;
	union nccl_ev_body cb = { .coll = { .func = "AllReduce", .count = 1024,
					    .datatype = "ncclFloat32", .n_channels = 1 } };

	setenv("RANKWATCH_JOB_ID", "period", 1);
	setenv("RANKWATCH_NCCL_SNAPSHOT_MS", "50", 1);
	CHECK_EQ(v5->init(&ctx, 3, &mask, "p", 1, 2, 0, logger), NCCL_OK);
	struct rw_ring *r = attach("period");
	void *op = start(ctx, NCCL_EV_COLL, NULL, cb);
	void *f = proxy_op(ctx, op, 0, 1, 1);
	struct timespec ms400 = { 0, 400000000 };
	nanosleep(&ms400, NULL);
	stop(f);
	stop(op);
	CHECK_EQ(v5->finalize(ctx), NCCL_OK);
	drain(r);
	int snaps = count(RW_REC_CHUNK, 0);
	printf("  %d chunk snapshots in 400 ms at a 50 ms period\n", snaps);
	CHECK(snaps >= 3 && snaps <= 12);
	unsetenv("RANKWATCH_NCCL_SNAPSHOT_MS");
	rw_ring__free(r);
}

int main(int argc, char **argv)
{
	const char *path = argc > 1 ? argv[1] : getenv("RANKWATCH_NCCL_PLUGIN");
	char prefix[64];

	setvbuf(stdout, NULL, _IOLBF, 0);
	CHECK(path != NULL);
	void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!lib)
		fprintf(stderr, "dlopen %s: %s\n", path, dlerror());
	CHECK(lib != NULL);
	v5 = dlsym(lib, "ncclProfiler_v5");
	v4 = dlsym(lib, "ncclProfiler_v4");
	*(void **)&snapshot_now = dlsym(lib, "rankwatch_nccl_snapshot_now");
	*(void **)&counters = dlsym(lib, "rankwatch_nccl_counters");
	CHECK(v5 && v4 && snapshot_now && counters);
	CHECK(strcmp(v5->name, "rankwatch") == 0);
	recs = calloc(MAX_RECS, sizeof(*recs));
	CHECK(recs != NULL);
	snprintf(prefix, sizeof(prefix), "/rwtest%d", (int)getpid());
	setenv("RANKWATCH_RING_PREFIX", prefix, 1);
	setenv("RANKWATCH_NCCL_SNAPSHOT_MS", "0", 1); /* the harness drives the snapshots */
	setenv("RANK", "0", 1);
	RUN(test_ring_allreduce_with_stall);
	RUN(test_full_pools_v4);
	RUN(test_snapshot_thread_concurrency);
	RUN(test_snapshot_period);
	const char *jobs[] = { "allreduce", "pools", "threads", "period" };
	for (int i = 0; i < 4; i++) {
		char name[256];

		rw_ring__name(name, sizeof(name), prefix, jobs[i], 0, "nccl");
		rw_ring__unlink(name);
	}
	free(recs);
	dlclose(lib);
	printf("test_nccl_plugin: %d checks passed\n", atomic_load(&rw_test_checks));
	return 0;
}
