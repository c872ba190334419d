"""KV arithmetic in whole blocks (issue 36, item 10): each of a request's sequences rounds up to
whole KV blocks, the prompt's full blocks counted once (``admission.limits.kv_for``), the largest
max_tokens that fits a room is its inverse, and vLLM's KV usage, a share of blocks
(https://github.com/vllm-project/vllm/issues/57336), is read as token slots of whole blocks."""

from __future__ import annotations

import itertools

from kvgate_agent.admission import AdmissionConfig, AdmissionRequest
from kvgate_agent.admission.limits import Limits, kv_for, round_up
from kvgate_agent.engines.scrape import parse_engine_metrics

BLOCK = 16


def test_each_sequence_rounds_up_to_whole_blocks() -> None:
    assert kv_for(10, 1, 4, BLOCK) == 4 * BLOCK  # a block per sequence, not round_up(14)
    assert kv_for(40, 1, 4, BLOCK) == 32 + 4 * BLOCK  # two full prompt blocks shared
    assert kv_for(32, 0, 3, BLOCK) == 32  # nothing of its own yet
    for prompt, out, bs in itertools.product(range(0, 70, 3), range(0, 40, 5), (1, 16, 32)):
        assert kv_for(prompt, out, 1, bs) == round_up(prompt + out, bs)  # n = 1: unchanged
        for n in (2, 3, 8):
            kv = kv_for(prompt, out, n, bs)
            assert kv % bs == 0 and kv >= prompt + n * out


def test_the_largest_max_tokens_within_a_room_is_kv_fors_inverse() -> None:
    limits = Limits(AdmissionConfig(block_size=BLOCK), 0.0, 16)
    for prompt, n, room in itertools.product(range(0, 80, 7), (1, 2, 4, 7), range(0, 400, 13)):
        best = limits.max_tokens_within(prompt, n, room, None)
        assert best is not None
        if best < 0:
            assert kv_for(prompt, 0, n, BLOCK) > room  # not even the prompt fits
            continue
        assert kv_for(prompt, best, n, BLOCK) <= room < kv_for(prompt, best + 1, n, BLOCK)


def test_vllm_block_usage_is_read_as_token_slots_of_whole_blocks() -> None:
    # vLLM #57336's case: 66.7 % of the blocks in use while 36.5 % of the token slots hold KV.
    # The usage is of blocks: used = blocks in use x block size.
    text = (
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="3000"} 1\n'
        "vllm:num_requests_running 7\nvllm:num_requests_waiting 0\n"
        "vllm:kv_cache_usage_perc 0.667\n"
    )
    sample = parse_engine_metrics(text)
    assert sample.kv_capacity_tokens == 48000
    assert sample.kv_used_tokens == 32016 == 2001 * 16  # 2,001 blocks, not 36.5 % of 48,000


def test_mean_age_of_the_requests_in_flight() -> None:
    """The mean seconds since admission of what is in flight (the expected wait's input), kept
    in O(1) by the sum of admission times and back to exactly 0 when the pod is idle."""
    limits = Limits(AdmissionConfig(block_size=BLOCK), 0.0, 16)
    assert limits.mean_age(5.0) == 0.0
    a = limits.reserve(AdmissionRequest("t", 10, 10), 10, 100.0)
    b = limits.reserve(AdmissionRequest("t", 10, 10), 10, 102.0)
    assert limits.mean_age(104.0) == 3.0  # (4 + 2) / 2
    limits.release(a, 105.0, 0.0, 1.0)
    assert limits.mean_age(105.0) == 3.0  # b alone
    limits.release(b, 106.0, 0.0, 1.0)
    assert limits.in_flight == 0 and limits.admitted_at_sum == 0.0
    assert limits.mean_age(200.0) == 0.0
