// SPDX-License-Identifier: Apache-2.0
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rw_env.h"

void rw_warn__stderr(const char *msg)
{
	fprintf(stderr, "rankwatch: %s\n", msg);
}

static void env__warn(rw_warn_fn warn, const char *fmt, const char *name, const char *val,
		      long min, long max, const char *def)
{
	char msg[512];

	snprintf(msg, sizeof(msg), fmt, name, val, min, max, def);
	(warn ? warn : rw_warn__stderr)(msg);
}

int rw_env__long(const char *name, long def, long min, long max, rw_warn_fn warn, long *out)
{
	const char *val = getenv(name);
	char defs[32], *end;
	long v;

	*out = def;
	if (!val || !*val)
		return 0;
	errno = 0;
	v = strtol(val, &end, 10);
	while (*end == ' ' || *end == '\t')
		end++;
	snprintf(defs, sizeof(defs), "%ld", def);
	if (errno || end == val || *end) {
		env__warn(warn, "%s=\"%.64s\" is not a whole number (expected %ld..%ld); using %s",
			  name, val, min, max, defs);
		return 0;
	}
	if (v < min || v > max) {
		env__warn(warn, "%s=%.64s is out of range %ld..%ld; using %s", name, val, min, max,
			  defs);
		return 0;
	}
	*out = v;
	return 1;
}

int rw_env__str(const char *name, const char *def, char *buf, size_t len, rw_warn_fn warn)
{
	const char *val = getenv(name);
	size_t n;

	snprintf(buf, len, "%s", def ? def : "");
	if (!val || !*val)
		return 0;
	n = strlen(val);
	if (n >= len || strspn(val, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
			       "0123456789_.,:/+-*") != n) {
		env__warn(warn, "%s=\"%.64s\" has characters outside [A-Za-z0-9_.,:/+-*] or is too "
			  "long (max %ld..%ld bytes); using \"%s\"", name, val, 1, (long)len - 1,
			  def ? def : "");
		return 0;
	}
	memcpy(buf, val, n + 1);
	return 1;
}

/*
 * The job id every ring of a rank is named with. Same order as the Python tracer
 * (ingest/torch/session.py), so one rank's rings agree: RANKWATCH_JOB_ID, RANKWATCH_JOB, torchrun's
 * TORCHELASTIC_RUN_ID, then "default".
 */
void rw_env__job_id(char *buf, size_t len, rw_warn_fn warn)
{
	static const char *const names[] = { "RANKWATCH_JOB_ID", "RANKWATCH_JOB",
					     "TORCHELASTIC_RUN_ID" };
	size_t i;

	for (i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (rw_env__str(names[i], "default", buf, len, warn))
			return;
	snprintf(buf, len, "%s", "default");
}
