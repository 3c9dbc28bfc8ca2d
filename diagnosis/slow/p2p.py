"""PP transfers, per link (sender → receiver): the transfer time of one Send/Recv pair is the
shorter of the two calls' times — the later poster's; the other includes waiting for it (the
AR node argument of VenusTrace §3.2.2 applied to a p2p pair) — summed per (step, link), and
compared with the links between the same pair of stages (`judge`: no cross-link verdict in a
peer set smaller than `min_peers`, only a change against the link's own noise, and there only
while the job's step time rose with it).
"""

from __future__ import annotations

import numpy as np

from diagnosis.columns import codes, col, ints
from diagnosis.conclusion import Suspicion
from diagnosis.rules.pipeline_ops import pp_call_microbatch
from diagnosis.slow import own_time
from diagnosis.slow.context import Array, Ctx, judge, reference
from diagnosis.window import Window


def suspects(ctx: Ctx, named: set[int]) -> list[Suspicion]:
    """PP transfers, per link (sender → receiver): the transfer time of one Send/Recv pair is
    the shorter of the two calls' times — the later poster's; the other includes waiting for
    it (the AR node's argument, VenusTrace, applied to a p2p pair) — summed per (step, link).
    An asynchronous send seen complete late (gloo's isend, at its rank's next call) makes the
    receive's time the shorter, and that receive holds its wait for a sender that posted late:
    a sender whose own compute slowed shows as its link too: a link whose sender's own time
    rose with it is no suspect (`_late_sender`), and one whose change began no earlier than a
    rank's own slowdown is explained by it (`_explained_links`). Bounding the
    transfer by the receive's end minus the later post would need the two hosts' clocks to
    agree to well under a transfer time; with the simulator's ±3 ms offsets it read most
    transfers as 0 and lost a slower NIC and PCIe link.
    Pairs: the n-th Send of a step from a to b with the n-th Recv of that step on b from a. The
    reference is the lower quartile over links of the same (sender stage, receiver stage);
    only hops between hosts are examined (a NIC carries them); thresholds as for the DP rings.
    A flagged link names its sender, whose NIC posts the data (component nic_rdma; stage
    pp_p2p, where the slower transfers were seen) when its
    typical (median) transfer is slower by `net_ratio`, else its proxy (host_software: a few
    transfers stall, Mycroft #7's intermittent late start), unless
    another suspect already names the rank — a slower GPU or PCIe path of a rank is that
    suspect's to explain. A second host-level fault that no DP ring shows (a ring of many
    members dilutes one slower hop) is found here."""
    ops = ctx.w.get("ops")
    if not ops or "peer" not in ops:
        return []
    # a PP transfer is a Send or Recv between ranks of different stages, on whichever
    # communicator the job sends it (its PP group, or the default group as plain
    # torch.distributed.isend does)
    uniq, code = codes(col(ops, "op"))
    send_code, recv_code = (int(np.searchsorted(uniq, name)) for name in ("Send", "Recv"))
    if send_code >= uniq.size or str(uniq[send_code]) != "Send":
        return []
    has_recv = recv_code < uniq.size and str(uniq[recv_code]) == "Recv"
    p2p_op = (code == send_code) | ((code == recv_code) if has_recv else False)
    rows = np.flatnonzero(p2p_op & ctx.ops_recent())
    if rows.size == 0:
        return []
    send = code[rows] == send_code
    world = ctx.w.grid.world
    rank = col(ops, "rank")[rows].astype(np.int64)
    peer = ints(ops, "peer")[rows]
    src, dst = np.where(send, rank, peer), np.where(send, peer, rank)
    hosts = host_codes(ctx.w)
    ok = (peer >= 0) & (peer < world) & (rank >= 0) & (rank < world)
    ok[ok] = (hosts[src[ok]] != hosts[dst[ok]]) & (  # a NIC carries the hop
        ctx.stage_of[src[ok]] != ctx.stage_of[dst[ok]])
    rows, send, src, dst, rank = rows[ok], send[ok], src[ok], dst[ok], rank[ok]
    if rows.size == 0:
        return []
    # a PP sender has two links (to the next and to the previous stage): link = 2·src + up,
    # and one call per microbatch on each; the 1F1B plan (pipeline_ops.pp_plan) gives each
    # call's microbatch from its op_seq, so the pair (link, step, microbatch) is a dense index
    up = (ctx.stage_of[dst] > ctx.stage_of[src]).astype(np.int64)
    link = 2 * src + up
    topo = ctx.w.topo
    # the stages the peers are grouped by: the topology's, or those the p2p pattern shows
    # for a job that declares no pipeline (`peer_stages`)
    pp = max(topo.pp, int(ctx.stage_of.max()) + 1)
    mb, ok = pp_call_microbatch(pp, topo.microbatches, ctx.stage_of[rank],
                                ints(ops, "op_seq")[rows], send, up == 1)
    if ok.sum() < 0.9 * ok.size:  # not a 1F1B plan: pairs unknown
        return []
    n_mb, n_steps, n_links = max(ctx.w.topo.microbatches, 1), ctx.steps.size, 2 * world
    si = ctx.step_index(ints(ops, "step", -1)[rows])
    pid = (link * n_steps + si) * n_mb + mb
    inside = (ints(ops, "t_end")[rows] - ints(ops, "t_start")[rows]).astype(np.float64)
    t_send = np.full(n_links * n_steps * n_mb, np.nan)
    t_recv = t_send.copy()
    ps, pr = ok & send, ok & ~send
    t_send[pid[ps]] = inside[ps]
    t_recv[pid[pr]] = inside[pr]
    tr = np.minimum(t_send, t_recv).reshape(n_links, n_steps, n_mb)  # nan unless paired
    paired = ~np.isnan(tr)
    m = np.where(paired.any(axis=2), np.nansum(tr, axis=2), np.nan).T  # [steps, links]
    cols = np.flatnonzero(paired.any(axis=(1, 2)))
    dst_of = np.full(n_links, -1, dtype=np.int64)
    dst_of[link] = dst
    ls, ld = cols // 2, dst_of[cols]
    m = m[:, cols]
    groups = ctx.stage_of[ls] * ctx.w.grid.pp + ctx.stage_of[ld]
    ref = reference(m, groups)
    v = judge(ctx, m, ctx.cfg.net_ratio, groups, ref=ref, floor=ctx.cfg.net_abs_ns, job_gate=False,
              sparse=True,
              confirmable=np.isin(ls, list(ctx.confirm)) & ctx.confirm_links)
    flag, exc, ratio = v.flag, v.exc, v.ratio
    out = []
    hit = np.flatnonzero(flag)
    hit = hit[np.argsort(-exc[hit], kind="stable")]
    cls = ctx.stage_of[ls] * ctx.w.grid.pp + ctx.stage_of[ld]
    senders = ls[hit]  # only the flagged senders' own time is asked (`_late_sender`)
    own = own_time.own_times(ctx, "model_fwd_loss", senders) + \
        own_time.own_times(ctx, "model_backward", senders)
    for i in hit.tolist():
        x = int(ls[i])
        if x in named or _late_sender(own[:, x], int(v.since[i]), float(exc[i])):
            continue
        named.add(x)  # one suspect per sender: its most delayed link
        # a slower NIC slows every transfer (the typical one too); a proxy that sometimes
        # starts late (Mycroft #7) leaves the typical transfer alone and stalls a few
        # (over the steps in which the link is slow: an onset inside the window does not
        # dilute it)
        hot = np.flatnonzero(m[:, i] >= ctx.cfg.net_ratio * ref[:, i])
        hot = hot if hot.size else np.arange(m.shape[0])
        like = tr[cols[cls == cls[i]]][:, hot]
        typical = float(np.nanmedian(tr[cols[i]][hot])) / max(float(np.nanmedian(like)), 1.0)
        nic = typical >= ctx.cfg.net_ratio
        out.append(Suspicion((x,), "pp_p2p", "nic_rdma" if nic else "host_software",
                             float(exc[i]), ("venustrace.ar_node",),
                             f"rank {x}: its PP transfers to rank {int(ld[i])} take "
                             f"{ratio[i]:.2f}x those of like links, +{exc[i] / 1e6:.1f} ms/step "
                             "(the later poster's time: no waiting); the typical transfer "
                             f"{typical:.2f}x: " + ("its NIC" if nic else
                                                    "a few stall, its proxy starts them late")
                             + f" ({v.how[i]} {v.z[i]:.1f}σ)", float(v.z[i]), str(v.how[i]),
                             int(ctx.steps[v.since[i]])))
    return out


def _late_sender(own: Array, since: int, excess: float) -> bool:
    """Whether the sender's own forward + backward time (`own_time`, per judged step) rose by
    at least half the link's excess per step since the link's onset row `since`: its receiver
    then waits for a sender that posts late, and with an asynchronous send seen complete late
    that wait is the pair's shorter time — the rank's compute, not its link (Mycroft §5,
    VenusTrace §3: communication is the root cause when the ranks' own work is normal). Own
    time trails the transfers by a step or two (a step's is known once the rank's calls of a
    later step are stored), so the link's own verdict can come first and the rank's own
    suspect not yet exist (a real pipeline's last stage 4x slower in its backward was named
    for its link for a second). Unknown rows do not count."""
    before, after = own[:since], own[since:]
    if not np.isfinite(before).any() or not np.isfinite(after).any():
        return False
    with np.errstate(all="ignore"):
        rise = float(np.nanmedian(after)) - float(np.nanmedian(before))
    return rise >= 0.5 * excess


def host_codes(w: Window) -> Array:
    """Host index per rank (equal host names → equal codes)."""
    return codes(np.asarray(w.grid.hosts, dtype=object))[1]


