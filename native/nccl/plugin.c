// SPDX-License-Identifier: Apache-2.0
/*
 * rankwatch NCCL profiler plugin (NCCL_PROFILER_PLUGIN=librankwatch_nccl.so), interface v4 and
 * v5. NCCL events become ring records:
 *
 *   Coll / P2p          -> `ops` (a start record, t_end 0; an end record when NCCL stopped the
 *                          op and every proxy op and kernel channel under it stopped)
 *   ProxyOp             -> `flows` at its stop (channel, peer, send/recv, steps, chunk size)
 *   ProxyStep states    -> the flow's chunk counters (Mycroft §4.2):
 *                          send: gpu_ready when a step leaves SendGPUWait, rdma_transmitted when
 *                          it is posted (SendWait), rdma_done when it completes (stop);
 *                          recv: rdma_transmitted when the receive is posted (RecvWait),
 *                          rdma_done when data arrived (RecvFlushWait/RecvGPUWait), gpu_ready
 *                          when the step is handed over (stop)
 *   NetPlugin (IB QP)   -> per-NIC posted/completed/bytes, sampled into `wr`
 *   KernelCh            -> op start/end times
 *
 * Proxy events exist only for network transports; ops over NVLink/SHM have kernel channels only.
 * Each event is one dispatch-table call: no allocation, no lock, no blocking; a full pool or ring
 * drops the event and counts it.
 */
#include <stddef.h>
#include <string.h>
#include <unistd.h>

#include "nccl_state.h"

#define RW_ACTIVATION_MASK                                                              \
	(NCCL_EV_COLL | NCCL_EV_P2P | NCCL_EV_PROXY_OP | NCCL_EV_PROXY_STEP |            \
	 NCCL_EV_KERNEL_CH | NCCL_EV_NET_PLUGIN)
#define RW_DETACHED_SEQ UINT64_MAX

enum { RW_STEP_LEFT_GPU = 1, RW_STEP_POSTED = 2, RW_STEP_ARRIVED = 4 };

_Static_assert(offsetof(struct nccl_ev_descr_v4, parent) == 8 &&
	       offsetof(struct nccl_ev_descr_v5, parent) == 8 &&
	       offsetof(struct nccl_ev_descr_v4, u) == 24 &&
	       offsetof(struct nccl_ev_descr_v5, u) == 24,
	       "v4 and v5 descriptors share their layout after the type");

static void bump_max(_Atomic int64_t *v, int64_t t)
{
	int64_t cur = atomic_load_explicit(v, memory_order_relaxed);

	while (cur < t && !atomic_compare_exchange_weak_explicit(v, &cur, t, memory_order_relaxed,
								 memory_order_relaxed))
		;
}

static void set_first(_Atomic int64_t *v, int64_t t)
{
	int64_t zero = 0;

	atomic_compare_exchange_strong_explicit(v, &zero, t, memory_order_relaxed,
						memory_order_relaxed);
}

/* Take a reference on a live op; 0 when it already ended (its last reference is gone). */
static int op__ref(struct rw_op *op)
{
	int r = atomic_load_explicit(&op->refs, memory_order_relaxed);

	while (r > 0)
		if (atomic_compare_exchange_weak_explicit(&op->refs, &r, r + 1,
							  memory_order_relaxed,
							  memory_order_relaxed))
			return 1;
	return 0;
}

/* The op a child event names as parent, if it is one of ours and still live. */
static struct rw_op *op__parent(void *parent)
{
	struct rw_op *op = parent;

	if (!parent || !rw_pool__owns(&rw_nccl.ops, parent))
		return NULL;
	if (atomic_load_explicit(&op->obj.state, memory_order_acquire) != RW_SLOT_BUSY)
		return NULL;
	return op__ref(op) ? op : NULL;
}

static void *start_op(struct rw_comm *comm, int is_coll, const union nccl_ev_body *b)
{
	struct rw_op *op = rw_pool__get(&rw_nccl.ops);
	struct rw_rec_op *r;
	uint8_t nch;

	if (!op)
		return NULL;
	r = &op->rec;
	memset(r, 0, sizeof(*r));
	r->comm_hash = comm->hash;
	r->op_seq = atomic_fetch_add_explicit(&comm->next_op_seq, 1, memory_order_relaxed);
	r->t_enqueue = rw_now_ns();
	r->step = -1;
	if (is_coll) {
		r->nccl_seq = b->coll.seq_number;
		r->count = b->coll.count;
		r->datatype = rw_nccl__dtype_size(b->coll.datatype);
		r->func = rw_nccl__func(b->coll.func);
		r->algo = rw_nccl__algo(b->coll.algo);
		r->proto = rw_nccl__proto(b->coll.proto);
		r->root = b->coll.root;
		r->peer = -1;
		r->nwarps = b->coll.n_warps;
		nch = b->coll.n_channels;
	} else {
		r->count = b->p2p.count;
		r->datatype = rw_nccl__dtype_size(b->p2p.datatype);
		r->func = rw_nccl__func(b->p2p.func);
		r->root = -1;
		r->peer = b->p2p.peer;
		nch = b->p2p.n_channels;
	}
	r->nchannels = nch;
	r->bytes = r->count * r->datatype;
	op->comm = comm;
	op->kch.tag = RW_OBJ_KCH;
	/* One reference for NCCL's own stop, which comes at enqueue time, before the op's proxy
	 * ops and kernel channels even start. So that the op does not end there, a second one is
	 * held until `nchannels` kernel channels stopped - once this process has seen NCCL emit
	 * kernel-channel events at all (RANKWATCH_NCCL_KERNEL_CH_WAIT=-1), or always (1), or
	 * never (0). Without it an op would wait forever for events that never come and look
	 * like a hang; with auto, only ops that start before the first kernel-channel event may
	 * end early (at their enqueue, or when their last running child stops). */
	op->kch_held = nch && (rw_nccl.set.kch_wait == 1 ||
			       (rw_nccl.set.kch_wait == -1 &&
				atomic_load_explicit(&rw_nccl.kch_seen, memory_order_relaxed)));
	atomic_store_explicit(&op->refs, op->kch_held ? 2 : 1, memory_order_relaxed);
	atomic_store_explicit(&op->kch_stopped, 0, memory_order_relaxed);
	atomic_store_explicit(&op->nchildren, 0, memory_order_relaxed);
	atomic_store_explicit(&op->t_start, 0, memory_order_relaxed);
	atomic_store_explicit(&op->t_end, 0, memory_order_relaxed);
	rw_pool__publish(op);
	rw_nccl__op_emit(op, 0);
	return op;
}

static void *start_coll(struct rw_comm *c, void *parent, const union nccl_ev_body *b)
{
	(void)parent;
	return start_op(c, 1, b);
}

static void *start_p2p(struct rw_comm *c, void *parent, const union nccl_ev_body *b)
{
	(void)parent;
	return start_op(c, 0, b);
}

static void *start_proxy_op(struct rw_comm *comm, void *parent, const union nccl_ev_body *b)
{
	struct rw_op *op = b->proxy_op.pid == rw_nccl.pid ? op__parent(parent) : NULL;
	struct rw_flow *f = rw_pool__get(&rw_nccl.flows);
	int64_t now = rw_now_ns();

	if (!f) {
		if (op)
			rw_nccl__op_unref(op);
		return NULL;
	}
	f->op = op;
	f->detached = !op;
	f->comm_hash = comm->hash;
	f->op_seq = op ? op->rec.op_seq : RW_DETACHED_SEQ;
	f->t_start = now;
	f->peer = b->proxy_op.peer;
	f->channel = b->proxy_op.channel_id;
	f->is_send = b->proxy_op.is_send != 0;
	f->nsteps = b->proxy_op.n_steps > 0 ? (uint32_t)b->proxy_op.n_steps : 0;
	f->chunk_size = b->proxy_op.chunk_size > 0 ? (uint32_t)b->proxy_op.chunk_size : 0;
	atomic_store_explicit(&f->gpu_ready, 0, memory_order_relaxed);
	atomic_store_explicit(&f->rdma_transmitted, 0, memory_order_relaxed);
	atomic_store_explicit(&f->rdma_done, 0, memory_order_relaxed);
	atomic_store_explicit(&f->bytes, 0, memory_order_relaxed);
	for (int i = 0; i < RW_STEP_SLOTS; i++)
		f->steps[i] = (struct rw_step){ .obj = { .tag = RW_OBJ_STEP }, .flow = f };
	if (op) {
		atomic_fetch_add_explicit(&op->nchildren, 1, memory_order_relaxed);
		set_first(&op->t_start, now);
	}
	rw_pool__publish(f);
	return f;
}

static struct rw_flow *flow__live(void *p)
{
	struct rw_flow *f = p;

	if (!p || !rw_pool__owns(&rw_nccl.flows, p))
		return NULL;
	uint8_t st = atomic_load_explicit(&f->obj.state, memory_order_relaxed);
	return st == RW_SLOT_BUSY || st == RW_SLOT_PINNED ? f : NULL;
}

static void *start_proxy_step(struct rw_comm *c, void *parent, const union nccl_ev_body *b)
{
	struct rw_flow *f = flow__live(parent);
	struct rw_step *s;

	(void)c;
	if (!f || b->proxy_step.step < 0)
		return NULL;
	s = &f->steps[b->proxy_step.step % RW_STEP_SLOTS];
	s->flags = 0;
	return s;
}

static void *start_kernel_ch(struct rw_comm *c, void *parent, const union nccl_ev_body *b)
{
	struct rw_op *op = op__parent(parent);

	(void)c;
	(void)b;
	if (!atomic_load_explicit(&rw_nccl.kch_seen, memory_order_relaxed))
		atomic_store_explicit(&rw_nccl.kch_seen, 1, memory_order_relaxed);
	if (!op)
		return NULL;
	atomic_fetch_add_explicit(&op->nchildren, 1, memory_order_relaxed);
	set_first(&op->t_start, rw_now_ns());
	return &op->kch;
}

static void *start_net(struct rw_comm *c, void *parent, const union nccl_ev_body *b)
{
	const struct nccl_net_ib_event_v1 *ib = b->net_plugin.data;
	uint32_t id = (uint32_t)b->net_plugin.id;
	struct rw_wr *wr;

	(void)c;
	(void)parent;
	if ((id & NCCL_NET_EV_TYPE_MASK) != NCCL_NET_EV_TYPE_IB ||
	    (id & NCCL_NET_EV_VER_MASK) != 1 || !ib || ib->type != NCCL_NET_IB_EV_QP ||
	    ib->qp.device < 0 || ib->qp.device >= RW_MAX_NICS)
		return NULL;
	wr = rw_pool__get(&rw_nccl.wrs);
	if (!wr)
		return NULL;
	wr->device = ib->qp.device;
	wr->length = ib->qp.length;
	atomic_fetch_add_explicit(&rw_nccl.nics[wr->device].posted, 1, memory_order_relaxed);
	rw_pool__publish(wr);
	return wr;
}

typedef void *(*start_fn)(struct rw_comm *c, void *parent, const union nccl_ev_body *b);

/* Indexed by the event type's bit number. */
static const start_fn start_table[] = {
	[1] = start_coll,      [2] = start_p2p,       [3] = start_proxy_op,
	[4] = start_proxy_step, [6] = start_kernel_ch, [7] = start_net,
};

static nccl_result_t start_event(void *ctx, void **handle, uint64_t type, void *parent,
				 const union nccl_ev_body *body)
{
	struct rw_comm *comm = ctx;
	unsigned bit;

	*handle = NULL;
	if (!comm || !rw_nccl.set.enable || !type || (type & (type - 1)))
		return NCCL_OK;
	bit = (unsigned)__builtin_ctzll(type);
	if (bit < sizeof(start_table) / sizeof(start_table[0]) && start_table[bit])
		*handle = start_table[bit](comm, parent, body);
	return NCCL_OK;
}

/* What a handle given back by NCCL is: pointer arithmetic only, so a stray pointer is
 * recognised as not ours instead of being dereferenced. */
static int handle__tag(void *h)
{
	const char *p = h;
	const struct rw_pool *ops = &rw_nccl.ops, *flows = &rw_nccl.flows;

	if (!h)
		return 0;
	if (rw_pool__owns(ops, h))
		return RW_OBJ_OP;
	if (ops->base && p >= ops->base && p < ops->base + ops->size * ops->stride &&
	    (size_t)(p - ops->base) % ops->stride == offsetof(struct rw_op, kch))
		return RW_OBJ_KCH;
	if (rw_pool__owns(flows, h))
		return RW_OBJ_FLOW;
	if (flows->base && p >= flows->base && p < flows->base + flows->size * flows->stride) {
		size_t off = (size_t)(p - flows->base) % flows->stride;

		if (off >= offsetof(struct rw_flow, steps) &&
		    (off - offsetof(struct rw_flow, steps)) % sizeof(struct rw_step) == 0)
			return RW_OBJ_STEP;
	}
	if (rw_pool__owns(&rw_nccl.wrs, h))
		return RW_OBJ_WR;
	atomic_fetch_add_explicit(&rw_nccl.bad_handles, 1, memory_order_relaxed);
	return 0;
}

static void step__stop(struct rw_step *s)
{
	struct rw_flow *f = s->flow;

	if (f->is_send && (s->flags & RW_STEP_POSTED))
		atomic_fetch_add_explicit(&f->rdma_done, 1, memory_order_relaxed);
	else if (!f->is_send && (s->flags & RW_STEP_ARRIVED))
		atomic_fetch_add_explicit(&f->gpu_ready, 1, memory_order_relaxed);
	s->flags = 0;
}

static nccl_result_t stop_event(void *h)
{
	int64_t now;

	switch (handle__tag(h)) {
	case RW_OBJ_OP:
		rw_nccl__op_unref(h);
		break;
	case RW_OBJ_KCH: {
		struct rw_op *op = (struct rw_op *)((char *)h - offsetof(struct rw_op, kch));

		bump_max(&op->t_end, rw_now_ns());
		if (atomic_fetch_add_explicit(&op->kch_stopped, 1, memory_order_relaxed) + 1 ==
		    op->rec.nchannels && op->kch_held)
			rw_nccl__op_unref(op); /* the reference held for the kernel channels */
		rw_nccl__op_unref(op);
		break;
	}
	case RW_OBJ_FLOW: {
		struct rw_flow *f = h;

		now = rw_now_ns();
		rw_nccl__flow_emit(f, now);
		if (f->op) {
			bump_max(&f->op->t_end, now);
			rw_nccl__op_unref(f->op);
		}
		rw_pool__put(&rw_nccl.flows, f);
		break;
	}
	case RW_OBJ_STEP:
		step__stop(h);
		break;
	case RW_OBJ_WR: {
		struct rw_wr *wr = h;
		struct rw_nic *nic = &rw_nccl.nics[wr->device];

		atomic_fetch_add_explicit(&nic->completed, 1, memory_order_relaxed);
		atomic_fetch_add_explicit(&nic->bytes_done, wr->length, memory_order_relaxed);
		rw_pool__put(&rw_nccl.wrs, wr);
		break;
	}
	default:
		break;
	}
	return NCCL_OK;
}

static void step__state(struct rw_step *s, int state, const union nccl_ev_state_args *args)
{
	struct rw_flow *f = s->flow;
	size_t size = args ? args->proxy_step.trans_size : 0;

	switch (state) {
	case NCCL_ST_STEP_SEND_PEER_WAIT:
	case NCCL_ST_STEP_SEND_WAIT:
		if (!(s->flags & RW_STEP_LEFT_GPU)) {
			s->flags |= RW_STEP_LEFT_GPU;
			atomic_fetch_add_explicit(&f->gpu_ready, 1, memory_order_relaxed);
		}
		if (state == NCCL_ST_STEP_SEND_WAIT && !(s->flags & RW_STEP_POSTED)) {
			s->flags |= RW_STEP_POSTED;
			atomic_fetch_add_explicit(&f->rdma_transmitted, 1, memory_order_relaxed);
			atomic_fetch_add_explicit(&f->bytes, size, memory_order_relaxed);
		}
		break;
	case NCCL_ST_STEP_RECV_WAIT:
		if (!(s->flags & RW_STEP_POSTED)) {
			s->flags |= RW_STEP_POSTED;
			atomic_fetch_add_explicit(&f->rdma_transmitted, 1, memory_order_relaxed);
		}
		break;
	case NCCL_ST_STEP_RECV_FLUSH_WAIT:
	case NCCL_ST_STEP_RECV_GPU_WAIT:
		if (!(s->flags & RW_STEP_ARRIVED)) {
			s->flags |= RW_STEP_ARRIVED;
			atomic_fetch_add_explicit(&f->rdma_done, 1, memory_order_relaxed);
			atomic_fetch_add_explicit(&f->bytes, size, memory_order_relaxed);
		}
		break;
	default:
		break;
	}
}

static nccl_result_t record_event_state(void *h, int state, union nccl_ev_state_args *args)
{
	if (handle__tag(h) == RW_OBJ_STEP)
		step__state(h, state, args);
	return NCCL_OK;
}

static nccl_result_t init_common(void **ctx, int *mask, const char *name, uint64_t hash,
				 int nnodes, int nranks, int rank, nccl_logger_t log)
{
	struct rw_comm *comm = NULL;

	*ctx = NULL;
	*mask = 0;
	if (rw_nccl__acquire(name, hash, nnodes, nranks, rank, log, &comm))
		return NCCL_OK; /* never fail the communicator: run without profiling */
	*ctx = comm;
	*mask = rw_nccl.set.enable ? RW_ACTIVATION_MASK : 0;
	return NCCL_OK;
}

static nccl_result_t init_v4(void **ctx, int *mask, const char *name, uint64_t hash,
			     int nnodes, int nranks, int rank, nccl_logger_t log)
{
	return init_common(ctx, mask, name, hash, nnodes, nranks, rank, log);
}

static nccl_result_t init_v5(void **ctx, uint64_t comm_id, int *mask, const char *name,
			     int nnodes, int nranks, int rank, nccl_logger_t log)
{
	return init_common(ctx, mask, name, comm_id, nnodes, nranks, rank, log);
}

static nccl_result_t start_v4(void *ctx, void **handle, struct nccl_ev_descr_v4 *d)
{
	return start_event(ctx, handle, d->type, d->parent, &d->u);
}

static nccl_result_t start_v5(void *ctx, void **handle, struct nccl_ev_descr_v5 *d)
{
	return start_event(ctx, handle, d->type, d->parent, &d->u);
}

static nccl_result_t finalize(void *ctx)
{
	if (ctx)
		rw_nccl__release(ctx);
	return NCCL_OK;
}

RW_API const struct nccl_profiler_v5 ncclProfiler_v5 = {
	.name = "rankwatch",
	.init = init_v5,
	.start_event = start_v5,
	.stop_event = stop_event,
	.record_event_state = record_event_state,
	.finalize = finalize,
};

RW_API const struct nccl_profiler_v4 ncclProfiler_v4 = {
	.name = "rankwatch",
	.init = init_v4,
	.start_event = start_v4,
	.stop_event = stop_event,
	.record_event_state = record_event_state,
	.finalize = finalize,
};

/* Test hooks: one synchronous snapshot pass (with RANKWATCH_NCCL_SNAPSHOT_MS=0 the harness
 * drives time), and the plugin's own counters {pool drops, foreign handles, lost (no ring)}. */
RW_API void rankwatch_nccl_snapshot_now(void)
{
	if (rw_nccl.set.enable)
		rw_nccl__snapshot(rw_now_ns());
}

RW_API void rankwatch_nccl_counters(uint64_t out[3])
{
	out[0] = atomic_load(&rw_nccl.pool_drops);
	out[1] = atomic_load(&rw_nccl.bad_handles);
	out[2] = atomic_load(&rw_nccl.no_ring);
}
