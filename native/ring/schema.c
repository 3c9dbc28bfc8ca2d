// SPDX-License-Identifier: Apache-2.0
/*
 * The record layout as text, so that readers in other languages (ingest/ring.py) build their
 * views from rw_record.h instead of a hand-kept copy: "kind.field:offset:type;" for every field,
 * where type is a numpy type code ("u8", "i4", "S88", "u4x3" for uint32_t[3]).
 */
#include <pthread.h>
#include <stdio.h>

#include "rw_ring.h"

struct field {
	const char *kind;
	const char *name;
	size_t offset;
	const char *type;
};

#define HEAD(m, t) { "head", #m, offsetof(struct rw_record, h.m), t }
#define F(k, m, t) { #k, #m, offsetof(struct rw_record, u.k.m), t }

static const struct field fields[] = {
	HEAD(seq, "u8"), HEAD(kind, "u2"), HEAD(flags, "u2"), HEAD(src, "u4"), HEAD(ts, "i8"),
	F(name, hash, "u8"), F(name, ns, "u2"), F(name, part, "u1"), F(name, nparts, "u1"),
	F(name, len, "u2"), F(name, total_len, "u2"), F(name, text, "S88"),
	F(comm, comm_hash, "u8"), F(comm, nranks, "i4"), F(comm, comm_rank, "i4"),
	F(comm, nnodes, "i4"), F(comm, rank, "i4"),
	F(op, comm_hash, "u8"), F(op, op_seq, "u8"), F(op, nccl_seq, "u8"), F(op, count, "u8"),
	F(op, bytes, "u8"), F(op, t_enqueue, "i8"), F(op, t_start, "i8"), F(op, t_end, "i8"),
	F(op, stream, "u8"), F(op, step, "i8"), F(op, peer, "i4"), F(op, root, "i4"),
	F(op, func, "u1"), F(op, datatype, "u1"), F(op, algo, "u1"), F(op, proto, "u1"),
	F(op, nchannels, "u1"), F(op, nwarps, "u1"), F(op, nchildren, "u2"),
	F(flow, comm_hash, "u8"), F(flow, op_seq, "u8"), F(flow, bytes, "u8"),
	F(flow, t_start, "i8"), F(flow, t_end, "i8"), F(flow, peer, "i4"), F(flow, channel, "u2"),
	F(flow, is_send, "u1"), F(flow, nsteps, "u4"), F(flow, chunk_size, "u4"),
	F(flow, gpu_ready, "u4"), F(flow, rdma_transmitted, "u4"), F(flow, rdma_done, "u4"),
	F(chunk, comm_hash, "u8"), F(chunk, op_seq, "u8"), F(chunk, channel, "u2"),
	F(chunk, is_send, "u1"), F(chunk, peer, "i4"), F(chunk, total_chunks, "u4"),
	F(chunk, gpu_ready, "u4"), F(chunk, rdma_transmitted, "u4"), F(chunk, rdma_done, "u4"),
	F(stage, step, "u8"), F(stage, t_start, "i8"), F(stage, data_next_wait, "u8"),
	F(stage, model_fwd_loss, "u8"), F(stage, model_backward, "u8"), F(stage, callbacks, "u8"),
	F(stage, optim_step, "u8"), F(stage, step_other, "u8"), F(stage, device_ns, "i8"),
	F(stage, sched_wait_ns, "i8"), F(stage, cpu_pressure_ns, "i8"),
	F(kernel, name_hash, "u8"), F(kernel, t_start, "i8"), F(kernel, duration, "u8"),
	F(kernel, stream, "u4"), F(kernel, device, "u4"), F(kernel, context, "u4"),
	F(kernel, correlation, "u4"), F(kernel, grid, "u4x3"), F(kernel, block, "u4x3"),
	F(kernel, shared_mem, "u4"), F(kernel, registers, "u2"),
	F(wr, nic_hash, "u8"), F(wr, inflight, "u8"), F(wr, bytes_done, "u8"), F(wr, posted, "u8"),
	F(wr, completed, "u8"), F(wr, device, "i4"),
	F(beat, comm_hash, "u8"), F(beat, last_op_seq, "i8"), F(beat, dropped, "u8"),
	F(beat, pool_dropped, "u8"),
};

static char schema[8192];
static pthread_once_t schema_once = PTHREAD_ONCE_INIT;

static void schema__build(void)
{
	size_t used = 0;

	for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
		int n = snprintf(schema + used, sizeof(schema) - used, "%s.%s:%zu:%s;",
				 fields[i].kind, fields[i].name, fields[i].offset, fields[i].type);

		if (n < 0 || (size_t)n >= sizeof(schema) - used) {
			schema[0] = '\0'; /* never a partial schema */
			return;
		}
		used += (size_t)n;
	}
}

const char *rw_record__schema(void)
{
	pthread_once(&schema_once, schema__build);
	return schema;
}
