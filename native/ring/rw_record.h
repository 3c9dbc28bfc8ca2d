/* SPDX-License-Identifier: Apache-2.0 */
/*
 * rankwatch ring records: fixed-size, 128 bytes, one kind tag per record.
 *
 * Every record starts with struct rw_rec_head (24 bytes); the rest is a union of per-kind
 * payloads (at most 104 bytes). Strings never travel in event records: names (communicators,
 * kernels, NICs) are 64-bit FNV-1a hashes, and a producer sends the text once in RW_REC_NAME
 * records (split into parts when longer than RW_NAME_PART bytes). The layout is exported at run
 * time by rw_record__schema() so the Python reader builds its numpy dtypes from this header and
 * never from a second copy.
 *
 * Field meanings follow the record contract (ingest/records.py, docs/records.md); times are int64
 * nanoseconds of CLOCK_REALTIME, 0 when the event has not happened yet.
 */
#ifndef RW_RECORD_H
#define RW_RECORD_H

#include <stddef.h>
#include <stdint.h>

#define RW_RECORD_SIZE 128
#define RW_NAME_PART 88   /* name bytes carried by one RW_REC_NAME record */
#define RW_NAME_MAX 256   /* longer names are truncated (RW_F_TRUNCATED) */

enum rw_kind {
	RW_REC_NONE = 0,
	RW_REC_NAME = 1,   /* hash -> text, sent once per name and producer */
	RW_REC_COMM = 2,   /* a communicator seen by the NCCL plugin */
	RW_REC_OP = 3,     /* contract `ops`: start (t_end 0) and end (RW_F_END) */
	RW_REC_FLOW = 4,   /* contract `flows`: one proxy op, at its end */
	RW_REC_CHUNK = 5,  /* contract `chunks`: snapshot of an in-flight proxy op */
	RW_REC_STAGE = 6,  /* contract `stages` */
	RW_REC_KERNEL = 7, /* contract `kernels` */
	RW_REC_WR = 8,     /* contract `wr` */
	RW_REC_BEAT = 9,   /* contract `beats` */
	RW_REC__MAX,
};

enum rw_name_ns {
	RW_NS_COMM = 1,
	RW_NS_KERNEL = 2,
	RW_NS_NIC = 3,
	RW_NS_OTHER = 4,
};

enum rw_flags {
	RW_F_END = 1u << 0,       /* op/flow finished; t_end is set */
	RW_F_DETACHED = 1u << 1,  /* parent op unknown (proxy in another process, dropped parent) */
	RW_F_TRUNCATED = 1u << 2, /* name longer than RW_NAME_MAX */
	RW_F_STALLED = 1u << 3,   /* chunk snapshot: no counter moved since the previous one */
	RW_F_FINAL = 1u << 4,     /* chunk snapshot taken when the proxy op stopped */
};

/* Which component wrote a record (head.src); one ring per component and rank. */
enum rw_source {
	RW_SRC_UNKNOWN = 0,
	RW_SRC_NCCL = 1,
	RW_SRC_CUPTI = 2,
	RW_SRC_PY = 3,
};

/* Collective/p2p function (op.func); the contract's `op` names, in this order. */
enum rw_func {
	RW_FUNC_OTHER = 0,
	RW_FUNC_ALLREDUCE, RW_FUNC_ALLGATHER, RW_FUNC_REDUCESCATTER, RW_FUNC_REDUCE,
	RW_FUNC_BROADCAST, RW_FUNC_ALLTOALL, RW_FUNC_SEND, RW_FUNC_RECV, RW_FUNC_BARRIER,
	RW_FUNC__MAX,
};

enum rw_algo { RW_ALGO_OTHER = 0, RW_ALGO_TREE, RW_ALGO_RING, RW_ALGO_COLLNET_DIRECT,
	       RW_ALGO_COLLNET_CHAIN, RW_ALGO_NVLS, RW_ALGO_NVLS_TREE, RW_ALGO_PAT, RW_ALGO__MAX };
enum rw_proto { RW_PROTO_OTHER = 0, RW_PROTO_LL, RW_PROTO_LL128, RW_PROTO_SIMPLE, RW_PROTO__MAX };

struct rw_rec_head {
	uint64_t seq;   /* commit word, owned by the ring (see ring.c); payload starts after */
	uint16_t kind;  /* enum rw_kind */
	uint16_t flags; /* enum rw_flags */
	uint32_t src;   /* enum rw_source */
	int64_t ts;     /* when the record was written */
};

struct rw_rec_name {
	uint64_t hash;
	uint16_t ns;        /* enum rw_name_ns */
	uint8_t part;       /* 0..nparts-1 */
	uint8_t nparts;
	uint16_t len;       /* bytes of text in this part */
	uint16_t total_len; /* bytes of the whole (possibly truncated) name */
	char text[RW_NAME_PART];
};

struct rw_rec_comm {
	uint64_t comm_hash;
	int32_t nranks;
	int32_t comm_rank;
	int32_t nnodes;
	int32_t rank;       /* global rank of the writer */
};

struct rw_rec_op {
	uint64_t comm_hash;
	uint64_t op_seq;    /* per communicator on this rank, from 0 (plugin-counted) */
	uint64_t nccl_seq;  /* NCCL's own seqNumber (per function), 0 for p2p */
	uint64_t count;     /* elements */
	uint64_t bytes;     /* count * sizeof(datatype) */
	int64_t t_enqueue;
	int64_t t_start;    /* first proxy op or kernel channel started; 0 if none yet */
	int64_t t_end;      /* last child stopped; 0 in flight */
	uint64_t stream;
	int64_t step;       /* -1 unknown */
	int32_t peer;       /* -1 collectives */
	int32_t root;       /* -1 where meaningless */
	uint8_t func;       /* enum rw_func */
	uint8_t datatype;   /* bytes per element, 0 unknown */
	uint8_t algo;       /* enum rw_algo */
	uint8_t proto;      /* enum rw_proto */
	uint8_t nchannels;
	uint8_t nwarps;
	uint16_t nchildren; /* proxy ops + kernel channels seen */
};

struct rw_rec_flow {
	uint64_t comm_hash;
	uint64_t op_seq;
	uint64_t bytes;
	int64_t t_start;
	int64_t t_end;
	int32_t peer;
	uint16_t channel;
	uint8_t is_send;
	uint8_t pad;
	uint32_t nsteps;
	uint32_t chunk_size;
	uint32_t gpu_ready;
	uint32_t rdma_transmitted;
	uint32_t rdma_done;
	uint32_t pad2;
};

struct rw_rec_chunk {
	uint64_t comm_hash;
	uint64_t op_seq;
	uint16_t channel;
	uint8_t is_send;
	uint8_t pad;
	int32_t peer;
	uint32_t total_chunks;
	uint32_t gpu_ready;
	uint32_t rdma_transmitted;
	uint32_t rdma_done;
};

struct rw_rec_stage {
	uint64_t step;
	int64_t t_start;
	uint64_t data_next_wait;
	uint64_t model_fwd_loss;
	uint64_t model_backward;
	uint64_t callbacks;
	uint64_t optim_step;
	uint64_t step_other;
	int64_t device_ns;
	int64_t sched_wait_ns; /* the training thread runnable, waiting for a CPU (-1: unknown) */
	int64_t cpu_pressure_ns; /* the host: some runnable task waiting for a CPU (PSI; -1: unknown) */
};

struct rw_rec_kernel {
	uint64_t name_hash;
	int64_t t_start;
	uint64_t duration;
	uint32_t stream;
	uint32_t device;
	uint32_t context;
	uint32_t correlation;
	uint32_t grid[3];
	uint32_t block[3];
	uint32_t shared_mem;
	uint16_t registers;
	uint16_t pad;
};

struct rw_rec_wr {
	uint64_t nic_hash;
	uint64_t inflight;
	uint64_t bytes_done;
	uint64_t posted;
	uint64_t completed;
	int32_t device;
	uint32_t pad;
};

struct rw_rec_beat {
	uint64_t comm_hash;
	int64_t last_op_seq;
	uint64_t dropped;   /* ring-full drops + pool-full drops of this producer */
	uint64_t pool_dropped;
};

struct rw_record {
	struct rw_rec_head h;
	union {
		struct rw_rec_name name;
		struct rw_rec_comm comm;
		struct rw_rec_op op;
		struct rw_rec_flow flow;
		struct rw_rec_chunk chunk;
		struct rw_rec_stage stage;
		struct rw_rec_kernel kernel;
		struct rw_rec_wr wr;
		struct rw_rec_beat beat;
		uint8_t raw[RW_RECORD_SIZE - sizeof(struct rw_rec_head)];
	} u;
};

_Static_assert(sizeof(struct rw_rec_head) == 24, "head is 24 bytes");
_Static_assert(sizeof(struct rw_record) == RW_RECORD_SIZE, "records are 128 bytes");
_Static_assert(sizeof(struct rw_rec_name) <= 104 && sizeof(struct rw_rec_op) <= 104 &&
	       sizeof(struct rw_rec_kernel) <= 104 && sizeof(struct rw_rec_flow) <= 104,
	       "payloads fit after the head");

/* 64-bit FNV-1a over at most `len` bytes (stops at NUL); never returns 0 (0 = "no name"). */
static inline uint64_t rw_hash__str(const char *s, size_t len)
{
	uint64_t h = 0xcbf29ce484222325ull;

	for (size_t i = 0; s && i < len && s[i]; i++) {
		h ^= (uint8_t)s[i];
		h *= 0x100000001b3ull;
	}
	return h ? h : 1;
}

#endif /* RW_RECORD_H */
