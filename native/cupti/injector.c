// SPDX-License-Identifier: Apache-2.0
/*
 * rankwatch CUPTI injector (CUDA_INJECTION64_PATH=librankwatch_cupti.so): concurrent-kernel
 * activity (name, stream, device, start, duration) into the rank's ring, after ARGUS §4.3 and
 * Appendix A:
 *
 *  - selective injection: only processes that are distributed workers (RANK or LOCAL_RANK set),
 *    whose name is allowed and whose command line is not a launcher's or a compiler's;
 *  - pre-allocated buffer reuse: RANKWATCH_CUPTI_BUFFERS buffers of RANKWATCH_CUPTI_BUFFER_KB,
 *    allocated once; CUPTI's request callback takes one, the parser gives it back;
 *  - bounded resources: when no buffer is free CUPTI gets none and drops (counted), the hand-off
 *    queue holds at most one entry per buffer, and a full ring drops and counts;
 *  - decoupled paths: the completion callback only queues the buffer; a worker thread parses it
 *    into the ring and flushes CUPTI every RANKWATCH_CUPTI_FLUSH_MS.
 *
 * libcupti is opened with dlopen (RANKWATCH_CUPTI_LIB, else libcupti.so.13, .so.12, .so), so this file
 * builds from headers alone. Nothing here may stop training: any failure disables tracing.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cupti_parse.h"
#include "rw_env.h"

#define RW_ARGV_MAX 64

struct cupti_api {
	CUptiResult (*register_callbacks)(CUpti_BuffersCallbackRequestFunc,
					  CUpti_BuffersCallbackCompleteFunc);
	CUptiResult (*enable)(CUpti_ActivityKind);
	CUptiResult (*next_record)(uint8_t *, size_t, CUpti_Activity **);
	CUptiResult (*flush_all)(uint32_t);
	CUptiResult (*get_timestamp)(uint64_t *);
	CUptiResult (*dropped)(CUcontext, uint32_t, size_t *);
};

static struct {
	struct cupti_api api;
	struct rw_ring *ring;
	struct rw_buf_pool pool;
	struct rw_name_set names;
	struct rw_cupti_stats stats;
	struct rw_cupti_sink sink;
	pthread_mutex_t lock; /* the hand-off queue */
	pthread_cond_t cond;
	uint8_t *queue[64];
	size_t queue_valid[64];
	unsigned head, count;
	int stopping, started;
	pthread_t worker;
	long flush_ms;
	_Atomic uint64_t cupti_dropped, foreign;
} inj = { .lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER };

static int next_record(uint8_t *buf, size_t valid, CUpti_Activity **rec)
{
	return inj.api.next_record(buf, valid, rec) != CUPTI_SUCCESS;
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records)
{
	uint8_t *buf = rw_buf_pool__take(&inj.pool);

	*buffer = buf; /* NULL: CUPTI drops records until a buffer comes back (counted) */
	*size = buf ? inj.pool.size : 0;
	*max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer,
				      size_t size, size_t valid)
{
	size_t dropped = 0;

	(void)size;
	if (inj.api.dropped && inj.api.dropped(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped)
		atomic_fetch_add(&inj.cupti_dropped, dropped);
	if (!buffer)
		return;
	pthread_mutex_lock(&inj.lock);
	if (inj.count < inj.pool.nbufs) { /* always true: one slot per buffer */
		unsigned tail = (inj.head + inj.count) % 64;

		inj.queue[tail] = buffer;
		inj.queue_valid[tail] = valid;
		inj.count++;
		pthread_cond_signal(&inj.cond);
		buffer = NULL;
	}
	pthread_mutex_unlock(&inj.lock);
	if (buffer && rw_buf_pool__give(&inj.pool, buffer))
		atomic_fetch_add(&inj.foreign, 1);
}

static void emit_beat(void)
{
	struct rw_ring_stat st;
	struct rw_record *rec;

	if (rw_ring__stat(inj.ring, &st))
		return;
	rec = rw_ring__reserve(inj.ring);
	if (!rec)
		return;
	memset(rec->u.raw, 0, sizeof(rec->u.raw));
	rec->h.kind = RW_REC_BEAT;
	rec->h.flags = 0;
	rec->h.src = RW_SRC_CUPTI;
	rec->h.ts = rw_now_ns();
	rec->u.beat.last_op_seq = -1;
	rec->u.beat.pool_dropped = atomic_load(&inj.cupti_dropped) +
				   atomic_load(&inj.pool.empty);
	rec->u.beat.dropped = st.drops + rec->u.beat.pool_dropped;
	rw_ring__commit(inj.ring, rec);
}

static void *worker_main(void *arg)
{
	struct timespec next;

	(void)arg;
	pthread_mutex_lock(&inj.lock);
	for (;;) {
		clock_gettime(CLOCK_REALTIME, &next);
		next.tv_sec += inj.flush_ms / 1000;
		next.tv_nsec += (inj.flush_ms % 1000) * 1000000l;
		next.tv_sec += next.tv_nsec / 1000000000l;
		next.tv_nsec %= 1000000000l;
		while (!inj.count && !inj.stopping &&
		       pthread_cond_timedwait(&inj.cond, &inj.lock, &next) != ETIMEDOUT)
			;
		if (!inj.count) {
			if (inj.stopping)
				break;
			/* Idle for a flush period: ask CUPTI for partly filled buffers. It calls
			 * buffer_completed, which takes the lock, so release it first. */
			pthread_mutex_unlock(&inj.lock);
			inj.api.flush_all(0);
			emit_beat();
			pthread_mutex_lock(&inj.lock);
			continue;
		}
		uint8_t *buf = inj.queue[inj.head];
		size_t valid = inj.queue_valid[inj.head];

		inj.head = (inj.head + 1) % 64;
		inj.count--;
		pthread_mutex_unlock(&inj.lock);
		rw_cupti__parse(buf, valid, next_record, &inj.sink);
		rw_buf_pool__give(&inj.pool, buf);
		pthread_mutex_lock(&inj.lock);
	}
	pthread_mutex_unlock(&inj.lock);
	return NULL;
}

static void worker__stop(void)
{
	pthread_mutex_lock(&inj.lock);
	inj.stopping = 1; /* the worker drains the queue before it stops */
	pthread_cond_signal(&inj.cond);
	pthread_mutex_unlock(&inj.lock);
	pthread_join(inj.worker, NULL);
}

static void at_exit(void)
{
	if (!inj.started)
		return;
	inj.api.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
	worker__stop();
	emit_beat();
	inj.started = 0;
}

/* argv of this process from /proc/self/cmdline, into buf; returns argc. */
static int read_argv(char *buf, size_t len, char *argv[], int max)
{
	int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC), argc = 0;
	ssize_t n;

	if (fd < 0)
		return 0;
	n = read(fd, buf, len - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = '\0';
	for (ssize_t i = 0; i < n && argc < max; i += (ssize_t)strlen(buf + i) + 1)
		argv[argc++] = buf + i;
	return argc;
}

static int load_cupti(void)
{
	char path[256];
	void *lib;

	/* An explicit RANKWATCH_CUPTI_LIB first, then CUDA 13's and CUDA 12's sonames, then the
	 * unversioned development link. The kernel fields read are at the same offsets in
	 * CUpti_ActivityKernel9 (CUPTI 12) and CUpti_ActivityKernel10 (CUPTI 13; checked against
	 * the CUDA 13.0 headers on an H100), and records are walked with CUPTI's own
	 * cuptiActivityGetNextRecord, so either library works. */
	static const char *const sonames[] = { "libcupti.so.13", "libcupti.so.12", "libcupti.so" };

	lib = NULL;
	if (rw_env__str("RANKWATCH_CUPTI_LIB", "", path, sizeof(path), NULL) && path[0])
		lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
	for (size_t i = 0; !lib && i < sizeof(sonames) / sizeof(sonames[0]); i++)
		lib = dlopen(sonames[i], RTLD_NOW | RTLD_GLOBAL);
	if (!lib)
		return -ENOENT;
	*(void **)&inj.api.register_callbacks = dlsym(lib, "cuptiActivityRegisterCallbacks");
	*(void **)&inj.api.enable = dlsym(lib, "cuptiActivityEnable");
	*(void **)&inj.api.next_record = dlsym(lib, "cuptiActivityGetNextRecord");
	*(void **)&inj.api.flush_all = dlsym(lib, "cuptiActivityFlushAll");
	*(void **)&inj.api.get_timestamp = dlsym(lib, "cuptiGetTimestamp");
	*(void **)&inj.api.dropped = dlsym(lib, "cuptiActivityGetNumDroppedRecords");
	if (!inj.api.register_callbacks || !inj.api.enable || !inj.api.next_record ||
	    !inj.api.flush_all || !inj.api.get_timestamp)
		return -ENOSYS;
	return 0;
}

static int injector__start(void)
{
	long enable, nbufs, kb, names, cap, rank;
	char argbuf[8192], prefix[64], job[RW_JOB_ID_MAX], allow[512], deny[512], name[256];
	char *argv[RW_ARGV_MAX];
	const char *why;
	uint64_t ts = 0;
	int argc, err, has_rank;

	rw_env__long("RANKWATCH_CUPTI_ENABLE", 1, 0, 1, NULL, &enable);
	if (!enable)
		return -ECANCELED;
	has_rank = rw_env__long("RANK", -1, 0, 0x7fffffff, NULL, &rank);
	if (!has_rank)
		has_rank = rw_env__long("LOCAL_RANK", -1, 0, 0x7fffffff, NULL, &rank);
	rw_env__str("RANKWATCH_CUPTI_ALLOW", "python,pt_main_thread", allow, sizeof(allow), NULL);
	rw_env__str("RANKWATCH_CUPTI_DENY", "torchrun,torch.distributed.run,"
		    "torch.distributed.launch,compile_worker,ninja,nvcc,ptxas,cicc", deny,
		    sizeof(deny), NULL);
	argc = read_argv(argbuf, sizeof(argbuf), argv, RW_ARGV_MAX);
	if (!rw_cupti__selected(argc, argv, has_rank, allow, deny, &why))
		return -ECANCELED; /* quietly: launchers and compilers are the common case */
	rw_env__long("RANKWATCH_CUPTI_BUFFERS", 8, 2, 64, NULL, &nbufs);
	rw_env__long("RANKWATCH_CUPTI_BUFFER_KB", 2048, 64, 65536, NULL, &kb);
	rw_env__long("RANKWATCH_CUPTI_NAMES", 16384, 256, 1 << 22, NULL, &names);
	rw_env__long("RANKWATCH_CUPTI_FLUSH_MS", 1000, 10, 60000, NULL, &inj.flush_ms);
	rw_env__long("RANKWATCH_CUPTI_RING_CAPACITY", 65536, 1024, RW_RING_MAX_CAPACITY, NULL,
		     &cap);
	rw_env__str("RANKWATCH_RING_PREFIX", "/rankwatch", prefix, sizeof(prefix), NULL);
	rw_env__job_id(job, sizeof(job), NULL);
	if (cap & (cap - 1)) {
		rw_warn__stderr("RANKWATCH_CUPTI_RING_CAPACITY is not a power of two; using 65536");
		cap = 65536;
	}
	if (names & (names - 1))
		names = 16384;
	err = load_cupti();
	if (err) {
		rw_warn__stderr("cannot load libcupti (set RANKWATCH_CUPTI_LIB); kernels untraced");
		return err;
	}
	struct rw_ring_opts opts = { .capacity = (uint64_t)cap, .rank = (int32_t)rank,
				     .source = RW_SRC_CUPTI, .job_id = job };
	err = rw_ring__name(name, sizeof(name), prefix, job, (int)rank, "cupti");
	err = err ?: rw_ring__create(name, &opts, &inj.ring);
	err = err ?: rw_buf_pool__init(&inj.pool, (size_t)nbufs, (size_t)kb * 1024);
	err = err ?: rw_name_set__init(&inj.names, (size_t)names);
	if (err) {
		rw_warn__stderr("cannot set up the kernel ring or buffers; kernels untraced");
		return err;
	}
	inj.api.get_timestamp(&ts);
	inj.sink = (struct rw_cupti_sink){ .ring = inj.ring,
					   .clock_offset = rw_now_ns() - (int64_t)ts,
					   .names = &inj.names, .stats = &inj.stats };
	if (pthread_create(&inj.worker, NULL, worker_main, NULL))
		return -EAGAIN;
	CUptiResult res = inj.api.register_callbacks(buffer_requested, buffer_completed);
	if (res == CUPTI_SUCCESS)
		res = inj.api.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
	if (res != CUPTI_SUCCESS) {
		char msg[160];

		snprintf(msg, sizeof(msg), "CUPTI refused activity tracing (CUptiResult %d: no "
			 "driver, or another profiler such as Kineto); kernels untraced", (int)res);
		rw_warn__stderr(msg);
		worker__stop();
		rw_ring__unlink(name); /* nothing was written: leave no stale ring behind */
		return -EBUSY;
	}
	inj.started = 1;
	atexit(at_exit);
	return 0;
}

static void injector__cleanup(void)
{
	rw_name_set__free(&inj.names);
	rw_buf_pool__free(&inj.pool);
	rw_ring__free(inj.ring);
	inj.ring = NULL;
}

static void init_once(void)
{
	int err = injector__start();

	if (err && !inj.started)
		injector__cleanup();
}

/* Called by the CUDA driver when it loads this file from CUDA_INJECTION64_PATH. Always reports
 * success: on any failure tracing simply stays off and training goes on. */
RW_API int InitializeInjection(void)
{
	static pthread_once_t once = PTHREAD_ONCE_INIT;

	pthread_once(&once, init_once);
	return 1;
}
