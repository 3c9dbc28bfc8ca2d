"""`rankwatch bench scale`'s summary: medians of interleaved repeats against one worker's."""

from bench.scale import Run, scaling


def run(n: int, load: str, gross: float, net: float, ingest: float = 0.0) -> Run:
    return Run(n, load, 1000, 1000, 1.0, [1.0] * n, 0.5, gross, 0.5, 0.01, net, [0.1] * n,
               ingest or gross)


def test_medians_of_repeats_over_one_workers_median() -> None:
    runs = [run(1, "big", 100, 110, 150), run(3, "big", 80, 100, 140),
            run(1, "big", 120, 130, 160), run(3, "big", 95, 120, 150),
            run(1, "big", 90, 90, 140), run(3, "big", 200, 200, 200)]
    got = {(g.workload, g.workers): g for g in scaling(runs)}
    one, three = got["big", 1], got["big", 3]
    assert (one.repeats, one.median, one.ratio) == (3, 100, 1.0)
    # the 200 outlier moves the median no more than one place
    assert (three.repeats, three.median, three.median_net) == (3, 95, 120)
    assert three.ratio == 0.95
    assert three.ratio_net == round(120 / 110, 3)
    # outside diagnosis: its own medians (150 of 140-160; 150 of 140-200)
    assert (one.median_ingest, three.median_ingest, three.ratio_ingest) == (150, 150, 1.0)
    # each three-worker turn over the one-worker turn just before it
    assert three.pair_ratios == [0.8, round(95 / 120, 3), round(200 / 90, 3)]
    assert one.pair_ratios == []


def test_workloads_apart_and_none_without_one_worker() -> None:
    runs = [run(1, "big", 100, 100), run(2, "big", 50, 50), run(3, "small", 10, 10)]
    got = scaling(runs)
    assert [(g.workload, g.workers, g.ratio) for g in got] == [("big", 1, 1.0), ("big", 2, 0.5)]
    assert got[1].pair_ratios == [0.5]  # "small" has no one-worker turn to pair with
