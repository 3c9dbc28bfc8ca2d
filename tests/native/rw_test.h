/* SPDX-License-Identifier: Apache-2.0 */
/* Minimal test helpers for the native tests: CHECK prints the failing expression and exits 1. */
#ifndef RW_TEST_H
#define RW_TEST_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <stdatomic.h>

static _Atomic int rw_test_checks; /* atomic: checks run in several threads */

#define CHECK(cond)                                                                  \
	do {                                                                         \
		rw_test_checks++;                                                    \
		if (!(cond)) {                                                       \
			fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, \
				#cond);                                              \
			exit(1);                                                     \
		}                                                                    \
	} while (0)

#define CHECK_EQ(a, b)                                                               \
	do {                                                                         \
		long long _a = (long long)(a), _b = (long long)(b);                  \
		rw_test_checks++;                                                    \
		if (_a != _b) {                                                      \
			fprintf(stderr, "%s:%d: CHECK_EQ failed: %s = %lld, %s = %lld\n", \
				__FILE__, __LINE__, #a, _a, #b, _b);                 \
			exit(1);                                                     \
		}                                                                    \
	} while (0)

#define RUN(test)                                                                    \
	do {                                                                         \
		test();                                                              \
		printf("ok %s\n", #test);                                           \
	} while (0)

/* A shm name unique to this process and test. */
#define TEST_RING_NAME(buf, tag) snprintf(buf, sizeof(buf), "/rwtest.%d.%s", (int)getpid(), tag)

#endif
