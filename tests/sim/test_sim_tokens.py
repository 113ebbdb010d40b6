"""The sim worker's fast token paths equal the plain reference function, row for row."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stepahead.plan import SamplingParams
from worker_service.sim import tokens
from worker_service.sim.tokens import TokenRule, extend, reference_next_token

# A small vocabulary with EOS ids makes re-draws (EOS, stop ids) frequent.
rules = st.builds(TokenRule, vocab_size=st.sampled_from([8, 4096, 128256]),
                  eos_token_ids=st.sampled_from([(), (3,), (5, 3)]),
                  eos_probability=st.sampled_from([0.0, 0.01, 0.3, 1.0]))
samplings = st.builds(SamplingParams, min_tokens=st.sampled_from([0, 0, 2, 50]),
                      stop_token_ids=st.sampled_from([(), (1,), (0, 2, 7)]), ignore_eos=st.booleans())
rows = st.tuples(st.integers(0, 2**64 - 1), st.integers(1, 8192), st.integers(0, 100), samplings)


@given(rules, rows)
def test_next_token_is_the_reference_function(rule: TokenRule, row) -> None:
    assert rule.next_token(*row) == reference_next_token(rule, *row)


@settings(max_examples=60)
@given(rules, st.lists(rows, min_size=1, max_size=3 * tokens._MIN_VECTOR_ROWS))
def test_advance_many_is_next_token_and_extend_per_row(rule: TokenRule, batch) -> None:
    """Below and above the vectorised path's threshold; masked rows, EOS draws and re-draws."""
    hashes, positions, outputs, samplings_ = map(list, zip(*batch))
    got, new_hashes = rule.advance_many(hashes, positions, outputs, samplings_)
    want = [reference_next_token(rule, *row) for row in batch]
    assert got == want
    assert new_hashes == [extend(h, (t,)) for h, t in zip(hashes, want)]
