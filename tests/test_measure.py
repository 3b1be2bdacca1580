"""The SLO search: which concurrency levels it serves and what it reports, on an engine whose
page latency is a known function of its concurrency."""

from types import SimpleNamespace

from ocriaquant.runtime.engine import Result
from ocriaquant.runtime.measure import pages_at_slo


class Fake:
    """Every page of a level takes 0.5 s × concurrency (no real time passes beyond a sleep-free
    loop); records the levels served."""

    def __init__(self, slots=64):
        self.runner = SimpleNamespace(max_slots=slots)
        self.served = []

    def generate(self, reqs, max_batch, stop_at_eos):
        self.served.append((max_batch, len(reqs)))
        for i, (_, n) in enumerate(reqs):
            yield Result(i, "", [0] * n, seconds=0.5 * max_batch, first_token_s=0.1)


def test_slo_search_finds_the_highest_concurrency_that_holds():
    eng = Fake()
    rep = pages_at_slo(eng, [{}], slo_p90=10.0, out_tokens=3)
    assert rep["concurrency"] == 20 and rep["p90_s"] == 10.0  # 0.5 × 20 = 10 holds, 24 does not
    served = [c for c, _ in eng.served]
    assert served[:3] == [8, 16, 32] and set(served[3:]) <= set(range(17, 32)) and 20 in served
    assert all(n == max(8, 2 * c) for c, n in eng.served)  # staggered: twice the level's pages
    assert [r["concurrency"] for r in rep["levels"]] == sorted(served)


def test_slo_search_halves_below_the_start_and_reports_a_miss():
    eng = Fake()
    rep = pages_at_slo(eng, [{}], slo_p90=1.0, out_tokens=1)
    assert rep["concurrency"] == 2 and [c for c, _ in eng.served] == [8, 4, 2, 3]  # 3 bisects 2..4
    eng = Fake()
    rep = pages_at_slo(eng, [{}], slo_p90=0.1, out_tokens=1)
    assert rep["concurrency"] is None and rep["pages_per_s"] == 0.0 and [c for c, _ in eng.served] == [8, 4, 2, 1]


def test_slo_search_stops_at_the_slots():
    eng = Fake(slots=12)
    rep = pages_at_slo(eng, [{}], slo_p90=100.0, out_tokens=1)
    assert rep["concurrency"] == 12 and max(c for c, _ in eng.served) == 12
