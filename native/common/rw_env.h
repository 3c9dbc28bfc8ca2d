/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Environment settings with range checks. A value that is not a whole number in range is
 * ignored with a warning that names the variable, the value and the range; the default is used.
 * No atoi(getenv()): a typo never turns into 0.
 */
#ifndef RW_ENV_H
#define RW_ENV_H

#include <stddef.h>

typedef void (*rw_warn_fn)(const char *msg);

/* Default warning sink: one line on stderr prefixed "rankwatch: ". */
void rw_warn__stderr(const char *msg);

/* *out = the value of `name` if it parses as an integer in [min, max], else def (warning when
 * set but invalid). Returns 1 when the environment value was used, 0 otherwise. */
int rw_env__long(const char *name, long def, long min, long max, rw_warn_fn warn, long *out);

/* Copies the value of `name` into buf if it is 1..len-1 bytes of [A-Za-z0-9_.,:/+-*], else
 * def (warning when set but invalid). Returns 1 when the environment value was used. */
int rw_env__str(const char *name, const char *def, char *buf, size_t len, rw_warn_fn warn);
void rw_env__job_id(char *buf, size_t len, rw_warn_fn warn);

#endif
