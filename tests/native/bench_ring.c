// SPDX-License-Identifier: Apache-2.0
/* ns per record of the ring's paths: reserve+fill+commit, write_batch(64), drain. One thread;
 * the ring is drained between rounds so nothing is dropped. Prints figures, asserts nothing. */

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "rw_ring.h"

#define CAP 65536u
#define ROUNDS 200

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(void)
{
	static struct rw_record out[CAP], batch[64];
	struct rw_ring_opts o = { .capacity = CAP, .rank = 0, .source = RW_SRC_UNKNOWN };
	struct rw_ring *p, *c;
	double t_commit = 0, t_batch = 0, t_drain = 0, t0;
	uint64_t n = 0;
	char name[64];

	snprintf(name, sizeof(name), "/rwbench.%d", (int)getpid());
	if (rw_ring__create(name, &o, &p) || rw_ring__attach(name, &c)) {
		fprintf(stderr, "bench_ring: cannot create %s\n", name);
		return 1;
	}
	memset(batch, 0, sizeof(batch));
	for (int r = 0; r < ROUNDS; r++) {
		t0 = now_s();
		for (uint32_t i = 0; i < CAP; i++) {
			struct rw_record *rec = rw_ring__reserve(p);

			rec->h.kind = RW_REC_KERNEL;
			rec->h.ts = (int64_t)i;
			rec->u.kernel.name_hash = i;
			rec->u.kernel.t_start = (int64_t)i;
			rec->u.kernel.duration = 1000;
			rw_ring__commit(p, rec);
		}
		t_commit += now_s() - t0;
		t0 = now_s();
		n += (uint64_t)rw_ring__drain(c, out, CAP, 0);
		t_drain += now_s() - t0;
		t0 = now_s();
		for (uint32_t i = 0; i < CAP / 64; i++)
			rw_ring__write_batch(p, batch, 64);
		t_batch += now_s() - t0;
		n += (uint64_t)rw_ring__drain(c, out, CAP, 0);
	}
	double per = 1e9 / ((double)CAP * ROUNDS);
	printf("ring: reserve+fill+commit %.1f ns/record, write_batch(64) %.1f ns/record, "
	       "drain %.1f ns/record (%llu records)\n", t_commit * per, t_batch * per,
	       t_drain * per, (unsigned long long)n);
	rw_ring__free(c);
	rw_ring__free(p);
	rw_ring__unlink(name);
	return 0;
}
