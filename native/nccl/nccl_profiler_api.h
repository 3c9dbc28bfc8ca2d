/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The parts of NCCL's profiler plugin interface (versions 4 and 5) that rankwatch uses, declared
 * here from the published interface (NCCL ext-profiler) so the plugin builds without NCCL.
 *
 * NCCL dlopens the file named by NCCL_PROFILER_PLUGIN and looks up the newest table it knows,
 * "ncclProfiler_v5" then "ncclProfiler_v4": a name and five functions. It calls init once per
 * communicator, startEvent/stopEvent/recordEventState from the user thread (group, collective,
 * p2p) and the proxy thread (proxy ops, proxy steps, kernel channels, network events), and
 * finalize when the communicator is destroyed.
 *
 * Event descriptors of v4 and v5 agree on every offset the plugin reads (type at 0 - one byte
 * in v4, eight in v5 -, parent at 8, rank at 16, the per-type union at 24); the static asserts
 * in plugin.c pin that.
 */
#ifndef RW_NCCL_PROFILER_API_H
#define RW_NCCL_PROFILER_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef int nccl_result_t;          /* ncclResult_t; 0 is success */
#define NCCL_OK 0
#define NCCL_ERR_INTERNAL 3

enum nccl_log_level { NCCL_LVL_NONE, NCCL_LVL_VERSION, NCCL_LVL_WARN, NCCL_LVL_INFO };
#define NCCL_LOG_FLAG_INIT 0x1ul
typedef void (*nccl_logger_t)(int level, unsigned long flags, const char *file, int line,
			      const char *fmt, ...);

/* Event types (bit flags; also the activation mask the plugin returns from init). */
enum {
	NCCL_EV_GROUP = 1 << 0,
	NCCL_EV_COLL = 1 << 1,
	NCCL_EV_P2P = 1 << 2,
	NCCL_EV_PROXY_OP = 1 << 3,
	NCCL_EV_PROXY_STEP = 1 << 4,
	NCCL_EV_PROXY_CTRL = 1 << 5,
	NCCL_EV_KERNEL_CH = 1 << 6,
	NCCL_EV_NET_PLUGIN = 1 << 7,
	/* v5 only: API-level events (not used by rankwatch) */
	NCCL_EV_GROUP_API = 1 << 8,
	NCCL_EV_COLL_API = 1 << 9,
	NCCL_EV_P2P_API = 1 << 10,
	NCCL_EV_KERNEL_LAUNCH = 1 << 11,
};

/* State transitions passed to recordEventState (numeric values are the interface's). */
enum nccl_ev_state {
	NCCL_ST_STEP_SEND_GPU_WAIT = 8,   /* waiting for the GPU to fill the step's buffer */
	NCCL_ST_STEP_SEND_WAIT = 9,       /* posted to the network, waiting for completion */
	NCCL_ST_STEP_RECV_WAIT = 10,      /* receive posted, waiting for data */
	NCCL_ST_STEP_RECV_FLUSH_WAIT = 11,/* data arrived, waiting for the GDR flush */
	NCCL_ST_STEP_RECV_GPU_WAIT = 12,  /* handed to the GPU, waiting for it to consume */
	NCCL_ST_PROXY_OP_IN_PROGRESS = 19,
	NCCL_ST_STEP_SEND_PEER_WAIT = 20, /* data ready, waiting for the receiver's credit */
	NCCL_ST_NET_PLUGIN_UPDATE = 21,
	NCCL_ST_KERNEL_CH_STOP = 22,
};

/* Network-plugin event ids: type in the high 16 bits, descriptor version in the low 16. */
#define NCCL_NET_EV_VER_MASK 0xffffu
#define NCCL_NET_EV_TYPE_MASK 0xffff0000u
#define NCCL_NET_EV_TYPE_IB (1u << 16)
#define NCCL_NET_IB_EV_QP 1 /* one InfiniBand work request */

struct nccl_net_ib_event_v1 {
	uint8_t type; /* NCCL_NET_IB_EV_QP */
	struct {
		int device;
		uint64_t wr_id;
		int opcode;
		int qp_num;
		size_t length;
	} qp;
};

/* The per-type part of an event descriptor, common to v4 and v5 (v5 appends parentGroup to
 * coll and p2p, which rankwatch does not read). */
union nccl_ev_body {
	struct {
		uint64_t seq_number;
		const char *func;
		const void *send_buff;
		void *recv_buff;
		size_t count;
		int root;
		const char *datatype;
		uint8_t n_channels;
		uint8_t n_warps;
		const char *algo;
		const char *proto;
	} coll;
	struct {
		const char *func;
		void *buff;
		const char *datatype;
		size_t count;
		int peer;
		uint8_t n_channels;
	} p2p;
	struct {
		pid_t pid; /* the proxy may run in another process: then parent is not ours */
		uint8_t channel_id;
		int peer;
		int n_steps;
		int chunk_size;
		int is_send;
	} proxy_op;
	struct {
		int step;
	} proxy_step;
	struct {
		uint8_t channel_id;
		uint64_t ptimer;
	} kernel_ch;
	struct {
		int64_t id;
		void *data;
	} net_plugin;
};

struct nccl_ev_descr_v4 {
	uint8_t type;
	void *parent;
	int rank;
	union nccl_ev_body u;
};

struct nccl_ev_descr_v5 {
	uint64_t type;
	void *parent;
	int rank;
	union nccl_ev_body u;
};

union nccl_ev_state_args {
	struct {
		size_t trans_size;
	} proxy_step;
	struct {
		int appended_proxy_ops;
	} proxy_ctrl;
	struct {
		void *data;
	} net_plugin;
	struct {
		uint64_t ptimer;
	} kernel_ch;
};

struct nccl_profiler_v4 {
	const char *name;
	nccl_result_t (*init)(void **ctx, int *mask, const char *comm_name, uint64_t comm_hash,
			      int n_nodes, int n_ranks, int rank, nccl_logger_t log);
	nccl_result_t (*start_event)(void *ctx, void **handle, struct nccl_ev_descr_v4 *d);
	nccl_result_t (*stop_event)(void *handle);
	nccl_result_t (*record_event_state)(void *handle, int state,
					    union nccl_ev_state_args *args);
	nccl_result_t (*finalize)(void *ctx);
};

struct nccl_profiler_v5 {
	const char *name;
	nccl_result_t (*init)(void **ctx, uint64_t comm_id, int *mask, const char *comm_name,
			      int n_nodes, int n_ranks, int rank, nccl_logger_t log);
	nccl_result_t (*start_event)(void *ctx, void **handle, struct nccl_ev_descr_v5 *d);
	nccl_result_t (*stop_event)(void *handle);
	nccl_result_t (*record_event_state)(void *handle, int state,
					    union nccl_ev_state_args *args);
	nccl_result_t (*finalize)(void *ctx);
};

#endif /* RW_NCCL_PROFILER_API_H */
