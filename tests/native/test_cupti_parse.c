// SPDX-License-Identifier: Apache-2.0
/*
 * The CUPTI injector's core without CUDA: synthetic buffers of CUpti_ActivityKernel9 records
 * parsed into a ring (fields, clock offset, names sent once and in parts, other kinds skipped,
 * full ring and full name set), the buffer pool under two threads, and selective injection.
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <pthread.h>
#include <string.h>

#include "cupti_parse.h"
#include "rw_test.h"

#define OFFSET 1000000000000ll

static const char *long_name =
	"void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>,"
	" at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, "
	"at::detail::Array<char*, 3>)";

static void kernel(rw_cupti_kernel *k, CUpti_ActivityKind kind, const char *name, uint64_t start,
		   uint32_t stream)
{
	memset(k, 0, sizeof(*k));
	k->kind = kind;
	k->name = name;
	k->start = start;
	k->end = start + 2500;
	k->streamId = stream;
	k->deviceId = 3;
	k->contextId = 1;
	k->correlationId = (uint32_t)start;
	k->gridX = 128;
	k->gridY = 1;
	k->gridZ = 1;
	k->blockX = 256;
	k->blockY = 1;
	k->blockZ = 1;
	k->staticSharedMemory = 1024;
	k->dynamicSharedMemory = 512;
	k->registersPerThread = 32;
}

static void test_layout_pinned(void)
{
	/* The fields read from CUPTI's records, at the offsets of the CUPTI 12.9 headers. */
	CHECK_EQ(offsetof(rw_cupti_kernel, kind), 0);
	CHECK_EQ(offsetof(rw_cupti_kernel, registersPerThread), 6);
	CHECK_EQ(offsetof(rw_cupti_kernel, start), 16);
	CHECK_EQ(offsetof(rw_cupti_kernel, end), 24);
	CHECK_EQ(offsetof(rw_cupti_kernel, deviceId), 40);
	CHECK_EQ(offsetof(rw_cupti_kernel, contextId), 44);
	CHECK_EQ(offsetof(rw_cupti_kernel, streamId), 48);
	CHECK_EQ(offsetof(rw_cupti_kernel, correlationId), 92);
	CHECK_EQ(offsetof(rw_cupti_kernel, name), 104);
}

static struct rw_ring *ring_of(const char *tag, uint64_t cap, struct rw_ring **consumer)
{
	struct rw_ring_opts o = { .capacity = cap, .rank = 0, .source = RW_SRC_CUPTI };
	struct rw_ring *p;
	char name[64];

	TEST_RING_NAME(name, tag);
	CHECK_EQ(rw_ring__create(name, &o, &p), 0);
	CHECK_EQ(rw_ring__attach(name, consumer), 0);
	rw_ring__unlink(name);
	return p;
}

static void test_parse_synthetic_buffer(void)
{
	rw_cupti_kernel buf[6];
	struct rw_record out[64];
	struct rw_name_set names;
	struct rw_cupti_stats st = { 0 };
	struct rw_ring *c, *p = ring_of("parse", 64, &c);
	struct rw_cupti_sink sink = { .ring = p, .clock_offset = OFFSET, .names = &names,
				      .stats = &st };
	int kernels = 0, name_recs = 0;

	CHECK_EQ(rw_name_set__init(&names, 64), 0);
	kernel(&buf[0], CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, "gemm", 1000, 7);
	kernel(&buf[1], CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, long_name, 2000, 7);
	kernel(&buf[2], CUPTI_ACTIVITY_KIND_MEMCPY, NULL, 3000, 7); /* not a kernel: skipped */
	kernel(&buf[3], CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, "gemm", 4000, 9);
	kernel(&buf[4], CUPTI_ACTIVITY_KIND_KERNEL, "ncclDevKernel_AllReduce", 5000, 13);
	kernel(&buf[5], CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, NULL, 6000, 7);
	CHECK_EQ(rw_cupti__parse((uint8_t *)buf, sizeof(buf), rw_cupti__next_packed, &sink), 5);
	CHECK_EQ(st.kernels, 5);
	CHECK_EQ(st.written, 5);
	CHECK_EQ(st.other, 1);
	CHECK_EQ(st.names, 4); /* gemm, the long one, the NCCL kernel, "<unknown>" */
	long n = rw_ring__drain(c, out, 64, 0);
	for (long i = 0; i < n; i++) {
		if (out[i].h.kind == RW_REC_NAME) {
			name_recs++;
			CHECK_EQ(out[i].u.name.ns, RW_NS_KERNEL);
			continue;
		}
		CHECK_EQ(out[i].h.kind, RW_REC_KERNEL);
		CHECK_EQ(out[i].h.src, RW_SRC_CUPTI);
		kernels++;
	}
	CHECK_EQ(kernels, 5);
	CHECK_EQ(name_recs, 3 + (strlen(long_name) + RW_NAME_PART - 1) / RW_NAME_PART); /* parts */
	const struct rw_rec_kernel *k = NULL;
	for (long i = 0; i < n; i++)
		if (out[i].h.kind == RW_REC_KERNEL && out[i].u.kernel.stream == 9)
			k = &out[i].u.kernel;
	CHECK(k != NULL);
	CHECK_EQ(k->t_start, 4000 + OFFSET);
	CHECK_EQ(k->duration, 2500);
	CHECK_EQ(k->device, 3);
	CHECK_EQ(k->correlation, 4000);
	CHECK(k->grid[0] == 128 && k->block[0] == 256 && k->shared_mem == 1536);
	CHECK_EQ(k->registers, 32);
	CHECK_EQ(k->name_hash, rw_hash__str("gemm", 16));
	/* Names go once: the same buffer again brings kernels only. */
	CHECK_EQ(rw_cupti__parse((uint8_t *)buf, sizeof(buf), rw_cupti__next_packed, &sink), 5);
	CHECK_EQ(rw_ring__drain(c, out, 64, 0), 5);
	/* A truncated buffer (valid size cuts the last record) yields only whole records. */
	CHECK_EQ(rw_cupti__parse((uint8_t *)buf, sizeof(buf[0]) * 2 + 10, rw_cupti__next_packed,
				 &sink), 2);
	rw_name_set__free(&names);
	rw_ring__free(c);
	rw_ring__free(p);
}

static void test_full_ring_and_full_names(void)
{
	static rw_cupti_kernel buf[40];
	static char names_txt[40][16];
	struct rw_name_set names;
	struct rw_cupti_stats st = { 0 };
	struct rw_ring_stat rs;
	struct rw_ring *c, *p = ring_of("full", 16, &c);
	struct rw_cupti_sink sink = { .ring = p, .names = &names, .stats = &st };

	CHECK_EQ(rw_name_set__init(&names, 8), 0); /* takes 6 names (3/4) */
	for (int i = 0; i < 40; i++) {
		snprintf(names_txt[i], sizeof(names_txt[i]), "k%d", i % 10);
		kernel(&buf[i], CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, names_txt[i],
		       (uint64_t)i * 10, 1);
	}
	CHECK_EQ(rw_cupti__parse((uint8_t *)buf, sizeof(buf), rw_cupti__next_packed, &sink), 40);
	CHECK_EQ(rw_ring__stat(c, &rs), 0);
	CHECK_EQ(rs.prod_pos, 16); /* the ring took 16 records, the rest were dropped */
	CHECK(rs.drops > 0);
	struct rw_record out[16];
	long n = rw_ring__drain(c, out, 16, 0), kernels = 0;
	for (long i = 0; i < n; i++)
		kernels += out[i].h.kind == RW_REC_KERNEL;
	CHECK_EQ(kernels, st.written); /* every kernel is in the ring or counted as dropped */
	CHECK_EQ(st.kernels, 40);
	CHECK(rs.drops >= 40 - st.written);
	CHECK_EQ(names.used, 6);
	CHECK(st.names_full > 0);
	CHECK_EQ(rw_name_set__add(&names, rw_hash__str("k0", 8)), 0);
	CHECK_EQ(rw_name_set__add(&names, 12345), -ENOSPC);
	rw_name_set__free(&names);
	rw_ring__free(c);
	rw_ring__free(p);
}

static void *churn(void *arg)
{
	struct rw_buf_pool *pool = arg;

	for (int i = 0; i < 100000; i++) {
		uint8_t *b = rw_buf_pool__take(pool);

		if (!b)
			continue;
		b[0] = (uint8_t)i; /* the buffer is ours until given back */
		CHECK_EQ(rw_buf_pool__give(pool, b), 0);
	}
	return NULL;
}

static void test_buffer_pool(void)
{
	struct rw_buf_pool pool;
	uint8_t *bufs[4];
	pthread_t t[2];

	CHECK_EQ(rw_buf_pool__init(&pool, 65, 4096), -EINVAL);
	CHECK_EQ(rw_buf_pool__init(&pool, 3, 4096), 0);
	for (int i = 0; i < 3; i++) {
		bufs[i] = rw_buf_pool__take(&pool);
		CHECK(bufs[i] != NULL && ((uintptr_t)bufs[i] % 8) == 0);
	}
	CHECK(rw_buf_pool__take(&pool) == NULL); /* exhausted: CUPTI gets no buffer, counted */
	CHECK_EQ(atomic_load(&pool.empty), 1);
	CHECK_EQ(rw_buf_pool__give(&pool, bufs[1]), 0);
	CHECK_EQ(rw_buf_pool__give(&pool, bufs[1]), -EINVAL); /* twice */
	CHECK_EQ(rw_buf_pool__give(&pool, bufs[0] + 1), -EINVAL); /* not a buffer start */
	CHECK(rw_buf_pool__take(&pool) == bufs[1]);
	for (int i = 0; i < 3; i++)
		CHECK_EQ(rw_buf_pool__give(&pool, bufs[i]), 0);
	for (int i = 0; i < 2; i++)
		CHECK_EQ(pthread_create(&t[i], NULL, churn, &pool), 0);
	for (int i = 0; i < 2; i++)
		pthread_join(t[i], NULL);
	CHECK_EQ(atomic_load(&pool.free_mask), 7);
	rw_buf_pool__free(&pool);
}

static void test_selective_injection(void)
{
	const char *allow = "python,pt_main_thread";
	const char *deny = "torchrun,torch.distributed.run,compile_worker,nvcc,ptxas";
	char *worker[] = { "/usr/bin/python3.11", "-u", "train.py", "--tp", "8" };
	char *launcher[] = { "/usr/bin/python3", "-m", "torch.distributed.run", "train.py" };
	char *torchrun[] = { "/opt/conda/bin/torchrun", "--nproc-per-node", "8", "train.py" };
	char *inductor[] = { "python3", "/x/torch/_inductor/compile_worker/__main__.py" };
	char *ptxas[] = { "/usr/local/cuda/bin/ptxas", "-arch=sm_90", "k.ptx" };
	char *bash[] = { "/bin/bash", "run.sh" };
	const char *why;

	CHECK_EQ(rw_cupti__selected(5, worker, 1, allow, deny, &why), 1);
	CHECK(why == NULL);
	CHECK_EQ(rw_cupti__selected(5, worker, 0, allow, deny, &why), 0);
	CHECK(strstr(why, "RANK") != NULL);
	CHECK_EQ(rw_cupti__selected(4, launcher, 1, allow, deny, &why), 0);
	CHECK_EQ(rw_cupti__selected(4, torchrun, 1, allow, deny, &why), 0);
	CHECK_EQ(rw_cupti__selected(2, inductor, 1, allow, deny, &why), 0);
	CHECK_EQ(rw_cupti__selected(3, ptxas, 1, allow, deny, &why), 0);
	CHECK_EQ(rw_cupti__selected(2, bash, 1, allow, deny, &why), 0);
	CHECK(strstr(why, "ALLOW") != NULL);
	CHECK_EQ(rw_cupti__selected(2, bash, 1, "*", deny, &why), 1); /* "*": any name */
}

/* The injector loaded as CUDA would, in a process that must not be traced, and in one whose
 * libcupti cannot be found: both return success and leave training alone. */
static void test_injector_entry_point(void)
{
	const char *path = getenv("RANKWATCH_CUPTI_INJECTOR");
	char name[128];

	if (!path) {
		printf("  (RANKWATCH_CUPTI_INJECTOR not set: entry point not exercised)\n");
		return;
	}
	void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	CHECK(lib != NULL);
	int (*init)(void);
	*(void **)&init = dlsym(lib, "InitializeInjection");
	CHECK(init != NULL);
	unsetenv("RANK");
	unsetenv("LOCAL_RANK");
	CHECK_EQ(init(), 1); /* no RANK: skipped quietly */
	CHECK_EQ(init(), 1); /* once only */
	dlclose(lib);
	snprintf(name, sizeof(name), "/rwtest%d", (int)getpid());
	setenv("RANKWATCH_RING_PREFIX", name, 1);
	setenv("RANK", "0", 1);
	setenv("RANKWATCH_CUPTI_ALLOW", "*", 1);
	setenv("RANKWATCH_CUPTI_LIB", "/nonexistent/libcupti.so", 1);
	unsetenv("RANKWATCH_JOB_ID");
	unsetenv("RANKWATCH_JOB");
	unsetenv("TORCHELASTIC_RUN_ID"); /* so the ring would be named with the job id "default" */
	lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	*(void **)&init = dlsym(lib, "InitializeInjection");
	CHECK_EQ(init(), 1); /* no libcupti here: warned, tracing off */
	struct rw_ring *r;
	CHECK_EQ(rw_ring__name(name, sizeof(name), getenv("RANKWATCH_RING_PREFIX"), "default", 0,
			       "cupti"), 0);
	CHECK_EQ(rw_ring__attach(name, &r), -ENOENT); /* nothing was created */
	dlclose(lib);
}

int main(void)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	RUN(test_layout_pinned);
	RUN(test_parse_synthetic_buffer);
	RUN(test_full_ring_and_full_names);
	RUN(test_buffer_pool);
	RUN(test_selective_injection);
	RUN(test_injector_entry_point);
	printf("test_cupti_parse: %d checks passed\n", atomic_load(&rw_test_checks));
	return 0;
}
