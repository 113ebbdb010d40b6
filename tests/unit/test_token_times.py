"""`LastTokenTimes` (the metrics' last-token times, with the last plain step kept as one pair)
against a plain dict, under random steps of plain tokens, other events and ends."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.token_times import LastTokenTimes

IDS = [f"r{i}" for i in range(6)]
actions = st.lists(st.one_of(
    st.tuples(st.just("plain"), st.lists(st.sampled_from(IDS), unique=True, max_size=6)),
    st.tuples(st.just("same"), st.none()),  # the previous plain step's requests again
    st.tuples(st.just("set"), st.sampled_from(IDS)),
    st.tuples(st.just("pop"), st.sampled_from(IDS)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(actions)
def test_it_reads_like_a_dict_of_last_token_times(steps):
    times, model, last_plain = LastTokenTimes(), {}, []
    for now, (kind, arg) in enumerate(steps, start=1):
        now = float(now)
        if kind in ("plain", "same"):
            ids = list(last_plain if kind == "same" else arg)
            ids = [rid for rid in ids if rid in model]  # plain tokens only follow a first token
            gaps, unseen = times.plain_step(ids, now)
            want = [now - model[rid] for rid in ids]
            got = [gaps] * len(ids) if isinstance(gaps, float) else gaps.tolist()
            assert got == want and unseen == []
            model.update(dict.fromkeys(ids, now))
            last_plain = ids
        elif kind == "set":
            times.set(arg, now)
            model[arg] = now
        else:
            times.pop(arg)
            model.pop(arg, None)
        for rid in IDS:
            assert times.get(rid) == model.get(rid), (rid, steps)


def test_a_request_never_seen_is_reported_and_not_tracked():
    times = LastTokenTimes()
    times.set("a", 1.0)
    gaps, unseen = times.plain_step(["a", "ghost"], 3.0)
    assert gaps[0] == 2.0 and math.isnan(gaps[1]) and unseen == ["ghost"]
    assert times.get("ghost") is None and times.get("a") == 3.0
