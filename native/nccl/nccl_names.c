// SPDX-License-Identifier: Apache-2.0
/* NCCL's strings (function, algorithm, protocol, datatype names) to the small codes of ring
 * records. Lookup tables, not if-chains; unknown names map to 0 ("other"). */
#include <string.h>

#include "nccl_state.h"

struct code {
	const char *name;
	uint8_t code;
};

static uint8_t lookup(const struct code *table, size_t n, const char *name)
{
	if (!name)
		return 0;
	for (size_t i = 0; i < n; i++)
		if (!strcmp(table[i].name, name))
			return table[i].code;
	return 0;
}

#define LOOKUP(table, name) lookup(table, sizeof(table) / sizeof(table[0]), name)

static const struct code funcs[] = {
	{ "AllReduce", RW_FUNC_ALLREDUCE }, { "AllGather", RW_FUNC_ALLGATHER },
	{ "ReduceScatter", RW_FUNC_REDUCESCATTER }, { "Reduce", RW_FUNC_REDUCE },
	{ "Broadcast", RW_FUNC_BROADCAST }, { "AllToAll", RW_FUNC_ALLTOALL },
	{ "Send", RW_FUNC_SEND }, { "Recv", RW_FUNC_RECV }, { "Barrier", RW_FUNC_BARRIER },
};

static const struct code algos[] = {
	{ "Tree", RW_ALGO_TREE }, { "Ring", RW_ALGO_RING },
	{ "CollNetDirect", RW_ALGO_COLLNET_DIRECT }, { "CollNetChain", RW_ALGO_COLLNET_CHAIN },
	{ "NVLS", RW_ALGO_NVLS }, { "NVLSTree", RW_ALGO_NVLS_TREE }, { "PAT", RW_ALGO_PAT },
};

static const struct code protos[] = {
	{ "LL", RW_PROTO_LL }, { "LL128", RW_PROTO_LL128 }, { "Simple", RW_PROTO_SIMPLE },
};

static const struct code dtypes[] = {
	{ "ncclInt8", 1 }, { "ncclUint8", 1 }, { "ncclInt32", 4 }, { "ncclUint32", 4 },
	{ "ncclInt64", 8 }, { "ncclUint64", 8 }, { "ncclFloat16", 2 }, { "ncclFloat32", 4 },
	{ "ncclFloat64", 8 }, { "ncclBfloat16", 2 }, { "ncclFloat8e4m3", 1 },
	{ "ncclFloat8e5m2", 1 },
};

uint8_t rw_nccl__func(const char *func)
{
	return LOOKUP(funcs, func);
}

uint8_t rw_nccl__algo(const char *algo)
{
	return LOOKUP(algos, algo);
}

uint8_t rw_nccl__proto(const char *proto)
{
	return LOOKUP(protos, proto);
}

uint8_t rw_nccl__dtype_size(const char *datatype)
{
	return LOOKUP(dtypes, datatype);
}
