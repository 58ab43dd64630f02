"""How `kiln run` schedules a prompt over an export's buckets, and what it refuses."""

import pytest

from kiln.core.run.decode import Step, check_request, parse_tokens, pick_bucket, prefill_steps
from kiln.core.errors import BadInput
from kiln.core.plan.recipe import Bucket

BUCKETS = [Bucket(1, 16), Bucket(2, 16), Bucket(4, 32), Bucket(1, 4)]


def test_narrowest_bucket_that_fits():
    assert pick_bucket(BUCKETS, 1) == Bucket(1, 4)
    assert pick_bucket(BUCKETS, 5) == Bucket(1, 16)
    assert pick_bucket(BUCKETS, 17) == Bucket(4, 32)
    with pytest.raises(ValueError):
        pick_bucket(BUCKETS, 33)


def test_long_prompts_are_chunked_by_the_widest_bucket():
    assert prefill_steps(BUCKETS, 3) == [Step(0, 3, Bucket(1, 4))]
    assert prefill_steps(BUCKETS, 70) == [Step(0, 32, Bucket(4, 32)), Step(32, 32, Bucket(4, 32)),
                                          Step(64, 6, Bucket(1, 16))]
    steps = prefill_steps([Bucket(1, 8)], 12)
    assert steps == [Step(0, 8, Bucket(1, 8)), Step(8, 4, Bucket(1, 8))]


def test_a_slot_cache_is_fed_in_chunks_that_fill_their_buckets():
    """DeepSeek-V4's state takes every token of a step: no padding, each chunk the widest bucket that fits."""
    buckets = [Bucket(1, 1), Bucket(2, 16), Bucket(1, 16), Bucket(1, 4)]
    assert prefill_steps(buckets, 23, padded=False) == [Step(0, 16, Bucket(1, 16)), Step(16, 4, Bucket(1, 4)),
                                                        Step(20, 1, Bucket(1, 1)), Step(21, 1, Bucket(1, 1)),
                                                        Step(22, 1, Bucket(1, 1))]
    with pytest.raises(ValueError, match="exactly 3 tokens.*bucket of 1 token"):
        prefill_steps([Bucket(1, 4)], 3, padded=False)


def test_requests_that_cannot_run_are_bad_input():
    check_request([1, 2], 3, vocab_size=10, context_tokens=4)  # 2 + 3 - 1 = 4 tokens of context
    with pytest.raises(BadInput, match="max_context_tokens"):
        check_request([1, 2], 4, vocab_size=10, context_tokens=4)
    with pytest.raises(BadInput, match="id 10 is outside the model's vocabulary"):
        check_request([1, 10], 1, vocab_size=10, context_tokens=64)
    with pytest.raises(BadInput, match="empty"):
        check_request([], 1, vocab_size=10, context_tokens=64)
    with pytest.raises(BadInput, match="at least 1"):
        check_request([1], 0, vocab_size=10, context_tokens=64)
    assert parse_tokens("1, 2,3") == [1, 2, 3]
    with pytest.raises(BadInput, match="comma-separated"):
        parse_tokens("1;2")
