/* SPDX-License-Identifier: Apache-2.0 */
/*
 * State of the rankwatch NCCL profiler plugin: settings, fixed pools allocated at the first
 * init, communicators, and the snapshot thread. plugin.c maps NCCL events onto these objects;
 * nccl_state.c owns their life cycle and writes records into the rank's ring.
 *
 * Every handle given to NCCL points at an object that starts with struct rw_obj, whose tag says
 * what it is. Pool slots are claimed with a CAS FREE -> BUSY, and freed with a store; a slot the
 * snapshot thread is reading is PINNED, and a stop that finds it pinned leaves it to the snapshot
 * thread to free (ZOMBIE), so neither side ever waits for the other.
 */
#ifndef RW_NCCL_STATE_H
#define RW_NCCL_STATE_H

#include <stdatomic.h>
#include <stdint.h>

#include "nccl_profiler_api.h"
#include "rw_ring.h"

#define RW_STEP_SLOTS 16  /* in-flight steps per proxy op (NCCL keeps at most 8) */
#define RW_MAX_NICS 32

enum rw_obj_tag { RW_OBJ_OP = 1, RW_OBJ_FLOW, RW_OBJ_STEP, RW_OBJ_WR, RW_OBJ_KCH };
enum rw_slot_state {
	RW_SLOT_FREE = 0,
	RW_SLOT_INIT,   /* claimed, being filled; invisible to the snapshot thread */
	RW_SLOT_BUSY,   /* live */
	RW_SLOT_PINNED, /* live, and the snapshot thread is reading it */
	RW_SLOT_ZOMBIE, /* stopped while pinned: the snapshot thread frees it */
};

struct rw_obj {
	uint8_t tag;
	_Atomic uint8_t state; /* enum rw_slot_state */
};

struct rw_comm {
	uint64_t hash;
	int nranks, comm_rank, nnodes;
	_Atomic uint64_t next_op_seq;
	_Atomic int64_t last_op_seq; /* last op that finished, -1 none */
	struct rw_comm *next;        /* list of live communicators, under the state mutex */
};

/* One collective or p2p call. Freed when NCCL stopped it and every child stopped. */
struct rw_op {
	struct rw_obj obj;
	struct rw_comm *comm;
	struct rw_rec_op rec;       /* the record, filled at start; times completed at the end */
	_Atomic int refs;           /* 1 for the op itself + one per running child */
	_Atomic int kch_stopped;    /* kernel channels that stopped */
	uint8_t kch_held;           /* holds a reference until nchannels kernel channels stop */
	_Atomic uint16_t nchildren;
	_Atomic int64_t t_start;    /* first child start */
	_Atomic int64_t t_end;      /* last child stop */
	struct rw_obj kch;          /* handle for this op's kernel-channel events */
};

struct rw_step {
	struct rw_obj obj;
	uint8_t flags; /* RW_STEP_*; only the proxy thread of the flow touches steps */
	struct rw_flow *flow;
};

/* One proxy op: a channel/peer transfer of an op (a `flows` record, and `chunks` snapshots). */
struct rw_flow {
	struct rw_obj obj;
	struct rw_op *op;               /* NULL when detached */
	/* identity, written before the slot becomes BUSY, read by the snapshot thread */
	uint64_t comm_hash, op_seq;
	int64_t t_start;
	int32_t peer;
	uint16_t channel;
	uint8_t is_send, detached;
	uint32_t nsteps, chunk_size;
	/* progress, written by the proxy thread */
	_Atomic uint32_t gpu_ready, rdma_transmitted, rdma_done;
	_Atomic uint64_t bytes;
	/* owned by the snapshot thread */
	uint64_t snap_key;        /* (op_seq, t_start) of the flow the values below belong to */
	uint32_t snap_seen[3];
	struct rw_step steps[RW_STEP_SLOTS];
};

/* One network work request (IB QP event). */
struct rw_wr {
	struct rw_obj obj;
	int device;
	uint64_t length;
};

struct rw_nic {
	_Atomic uint64_t posted, completed, bytes_done;
	_Atomic int named;
};

struct rw_settings {
	long enable, ring_capacity, op_pool, flow_pool, wr_pool, snapshot_ms, beat_ms, rank;
	long kch_wait; /* -1 auto, 0 never, 1 always: see plugin.c start_op */
	char prefix[64], job_id[RW_JOB_ID_MAX];
};

struct rw_pool {
	char *base;
	size_t size, stride;
	_Atomic uint64_t cursor;
};

/* Process-wide plugin state (one per process, shared by all communicators). */
struct rw_nccl {
	struct rw_settings set;
	struct rw_ring *ring;
	struct rw_pool ops, flows, wrs;
	struct rw_nic nics[RW_MAX_NICS];
	_Atomic uint64_t pool_drops;   /* events dropped because a pool was full */
	_Atomic uint64_t bad_handles;  /* handles/parents that were not ours */
	_Atomic uint64_t no_ring;      /* records lost because the ring could not be created */
	_Atomic int kch_seen;          /* NCCL emits kernel-channel events in this process */
	nccl_logger_t log;
	int pid;
};

extern struct rw_nccl rw_nccl;

/* nccl_state.c */
int rw_nccl__acquire(const char *comm_name, uint64_t comm_hash, int nnodes, int nranks,
		     int comm_rank, nccl_logger_t log, struct rw_comm **out);
void rw_nccl__release(struct rw_comm *comm);
void *rw_pool__get(struct rw_pool *pool);
void rw_pool__publish(void *obj);
void rw_pool__put(struct rw_pool *pool, void *obj);
int rw_pool__owns(const struct rw_pool *pool, const void *obj);
void rw_nccl__op_emit(struct rw_op *op, int end);
void rw_nccl__op_unref(struct rw_op *op);
void rw_nccl__flow_emit(struct rw_flow *flow, int64_t t_end);
void rw_nccl__snapshot(int64_t now);
void rw_nccl__warn(const char *msg);
struct rw_record *rw_nccl__reserve(uint16_t kind, uint16_t flags);
void rw_nccl__commit(struct rw_record *rec);
void rw_nccl__emit_name(uint16_t ns, uint64_t hash, const char *text);

/* nccl_names.c: NCCL's strings to record codes */
uint8_t rw_nccl__func(const char *func);
uint8_t rw_nccl__algo(const char *algo);
uint8_t rw_nccl__proto(const char *proto);
uint8_t rw_nccl__dtype_size(const char *datatype);

#endif /* RW_NCCL_STATE_H */
