// SPDX-License-Identifier: Apache-2.0
/* Name records: the text behind a 64-bit hash, split into RW_NAME_PART-byte parts. */
#include <errno.h>
#include <string.h>

#include "rw_ring.h"

int rw_ring__write_name(struct rw_ring *ring, uint32_t src, uint16_t ns, uint64_t hash,
			const char *text)
{
	size_t len = text ? strnlen(text, RW_NAME_MAX + 1) : 0;
	uint16_t flags = len > RW_NAME_MAX ? RW_F_TRUNCATED : 0;
	int64_t now = rw_now_ns();
	uint8_t nparts;

	if (!ring)
		return -EINVAL;
	if (len > RW_NAME_MAX)
		len = RW_NAME_MAX;
	nparts = (uint8_t)((len + RW_NAME_PART - 1) / RW_NAME_PART);
	if (!nparts)
		nparts = 1;
	for (uint8_t part = 0; part < nparts; part++) {
		struct rw_record *rec = rw_ring__reserve(ring);
		size_t off = (size_t)part * RW_NAME_PART, n = len - off;

		if (!rec)
			return -ENOSPC; /* counted as a drop by the ring */
		if (n > RW_NAME_PART)
			n = RW_NAME_PART;
		memset(rec->u.raw, 0, sizeof(rec->u.raw));
		rec->h.kind = RW_REC_NAME;
		rec->h.flags = flags;
		rec->h.src = src;
		rec->h.ts = now;
		rec->u.name.hash = hash;
		rec->u.name.ns = ns;
		rec->u.name.part = part;
		rec->u.name.nparts = nparts;
		rec->u.name.len = (uint16_t)n;
		rec->u.name.total_len = (uint16_t)len;
		if (n)
			memcpy(rec->u.name.text, text + off, n);
		rw_ring__commit(ring, rec);
	}
	return 0;
}
