"""Engine metrics parsing (vLLM, SGLang, TGI, trtllm) with validation, and staleness per pod.

Exposition texts are written by hand in each engine's real format (``# HELP``/``# TYPE`` lines,
labels, float values), after vllm/v1/metrics/loggers.py, sglang/srt/metrics/collector.py and
TGI's metrics.md.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate_agent.engines.scrape import EngineSample, parse_engine_metrics
from kvgate_agent.node.engine import EngineView
from kvgate_bench.kit.toolkit import FakeClock

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

CACHE_CONFIG_LABELS = (
    'block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",'
    'enable_prefix_caching="True",engine="{engine}",gpu_memory_utilization="0.9",'
    'is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="{blocks}",'
    'num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",'
    'swap_space="4",swap_space_bytes="4294967296"'
)


def vllm_text(
    running: str = "3.0",
    waiting: str = "1.0",
    usage: str = "0.25",
    preemptions: str = "7.0",
    blocks: str = "2048",
    engines: tuple[str, ...] = ("0",),
    usage_name: str = "vllm:kv_cache_usage_perc",
) -> str:
    """A vLLM v1 exposition; with several ``engines`` (DP ranks), each gets the same values."""

    def per_engine(name: str, value: str) -> str:
        return "".join(f'{name}{{engine="{e}",model_name="{MODEL}"}} {value}\n' for e in engines)

    cache = "".join(
        f"vllm:cache_config_info{{{CACHE_CONFIG_LABELS.format(engine=e, blocks=blocks)}}} 1.0\n"
        for e in engines
    )
    return f"""\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 12345.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
{per_engine("vllm:num_requests_running", running)}\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
{per_engine("vllm:num_requests_waiting", waiting)}\
# HELP {usage_name} KV-cache usage. 1 means 100 percent usage.
# TYPE {usage_name} gauge
{per_engine(usage_name, usage)}\
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
{per_engine("vllm:num_preemptions_total", preemptions)}\
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
{per_engine("vllm:prompt_tokens_total", "123456.0")}\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",model_name="{MODEL}"}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="{MODEL}"}} 42.0
vllm:time_to_first_token_seconds_count{{engine="0",model_name="{MODEL}"}} 42.0
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="{MODEL}"}} 3.14
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
{cache}"""


SGLANG_LABELS = f'engine_type="unified",model_name="{MODEL}",pp_rank="0",tp_rank="0"'


def sglang_text(
    usage: str = "0.41",
    used: str = "193215.0",
    capacity: str = "471258.0",
    with_capacity: bool = True,
) -> str:
    capacity_lines = (
        f"""\
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{{{SGLANG_LABELS}}} {capacity}
"""
        if with_capacity
        else ""
    )
    return f"""\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{SGLANG_LABELS}}} 12.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{{{SGLANG_LABELS}}} {used}
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{{SGLANG_LABELS}}} {usage}
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{{{SGLANG_LABELS}}} 1834.7
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{{SGLANG_LABELS}}} 4.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{{{SGLANG_LABELS}}} 0.33
{capacity_lines}\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{{{SGLANG_LABELS}}} 8.1234e+06
"""


TGI_TEXT = """\
# TYPE tgi_request_count counter
tgi_request_count 1032
# TYPE tgi_request_success counter
tgi_request_success 1029
# TYPE tgi_request_failure counter
tgi_request_failure{err="overloaded"} 3
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 6
# TYPE tgi_queue_size gauge
tgi_queue_size 2
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 11264
# TYPE tgi_request_duration histogram
tgi_request_duration_bucket{le="0.5"} 10
tgi_request_duration_bucket{le="+Inf"} 1029
tgi_request_duration_sum 2345.6
tgi_request_duration_count 1029
"""

TRTLLM_TEXT = """\
# HELP trtllm_num_requests_running Number of requests currently running.
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{model_name="llama"} 5.0
# HELP trtllm_num_requests_waiting Number of requests waiting.
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{model_name="llama"} 0.0
# HELP trtllm_kv_cache_utilization KV cache utilization.
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{model_name="llama"} 0.5
# TYPE trtllm_kv_cache_tokens_per_block gauge
trtllm_kv_cache_tokens_per_block{model_name="llama"} 32.0
# TYPE trtllm_kv_cache_max_blocks gauge
trtllm_kv_cache_max_blocks{model_name="llama"} 1000.0
"""


# -- each engine -----------------------------------------------------------------------------------


def test_vllm() -> None:
    s = parse_engine_metrics(vllm_text())
    assert s.ok and s.reason is None and s.engine == "vllm"
    assert (s.running, s.waiting, s.preemptions_total) == (3, 1, 7)
    assert s.kv_usage == 0.25
    assert s.kv_capacity_tokens == 2048 * 16
    assert s.kv_used_tokens == 8192
    assert s.invalid == {}
    assert isinstance(s.running, int) and isinstance(s.kv_capacity_tokens, int)


def test_vllm_data_parallel_sums_counts_and_takes_max_usage() -> None:
    text = vllm_text(engines=("0", "1"))
    text = text.replace(
        f'vllm:kv_cache_usage_perc{{engine="1",model_name="{MODEL}"}} 0.25',
        f'vllm:kv_cache_usage_perc{{engine="1",model_name="{MODEL}"}} 0.75',
    )
    s = parse_engine_metrics(text)
    assert (s.running, s.waiting, s.preemptions_total) == (6, 2, 14)
    assert s.kv_usage == 0.75  # the fullest pool decides
    assert s.kv_capacity_tokens == 2 * 2048 * 16  # one pool per DP engine
    assert s.kv_used_tokens == math.ceil(0.75 * 2 * 2048 * 16)  # upper bound


def test_old_vllm_fallback_name_only_when_new_absent() -> None:
    old = parse_engine_metrics(vllm_text(usage_name="vllm:gpu_cache_usage_perc", usage="0.5"))
    assert old.kv_usage == 0.5
    both = vllm_text(usage="0.1") + (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        f'vllm:gpu_cache_usage_perc{{model_name="{MODEL}"}} 0.9\n'
    )
    assert parse_engine_metrics(both).kv_usage == 0.1


def test_vllm_capacity_not_reported_or_bad_labels() -> None:
    text = vllm_text()
    no_info = text[: text.index("# HELP vllm:cache_config_info")]
    s = parse_engine_metrics(no_info)
    assert s.kv_capacity_tokens is None and s.kv_used_tokens is None and s.invalid == {}
    bad = parse_engine_metrics(vllm_text(blocks="None"))
    assert bad.kv_capacity_tokens is None and bad.kv_used_tokens is None
    assert "num_gpu_blocks='None'" in bad.invalid["kv_capacity_tokens"]
    assert "kv_used_tokens" in bad.invalid
    assert bad.kv_usage == 0.25 and bad.running == 3  # other fields unaffected
    zero = parse_engine_metrics(vllm_text(blocks="0"))
    assert zero.kv_capacity_tokens is None and "kv_capacity_tokens" in zero.invalid


def test_sglang() -> None:
    s = parse_engine_metrics(sglang_text())
    assert s.ok and s.engine == "sglang"
    assert (s.running, s.waiting) == (12, 4)
    assert s.kv_usage == 0.41
    assert s.kv_capacity_tokens == 471258
    assert s.kv_used_tokens == 193215
    assert s.preemptions_total is None  # read for vLLM only
    assert s.invalid == {}


def test_sglang_capacity_from_cache_config_info() -> None:
    text = sglang_text(with_capacity=False) + (
        "# HELP sglang:cache_config_info Information of the KV cache configuration\n"
        "# TYPE sglang:cache_config_info gauge\n"
        f'sglang:cache_config_info{{{SGLANG_LABELS},num_pages="29453",page_size="16"}} 1.0\n'
    )
    s = parse_engine_metrics(text)
    assert s.kv_capacity_tokens == 29453 * 16


def test_sglang_used_above_capacity_is_invalid() -> None:
    s = parse_engine_metrics(sglang_text(used="500000.0"))
    assert s.kv_used_tokens is None and "exceed" in s.invalid["kv_used_tokens"]
    assert s.kv_capacity_tokens == 471258


def test_tgi() -> None:
    s = parse_engine_metrics(TGI_TEXT)
    assert s.ok and s.engine == "tgi"
    assert (s.running, s.waiting, s.kv_used_tokens) == (6, 2, 11264)
    assert s.kv_usage is None and s.kv_capacity_tokens is None  # TGI reports neither
    assert s.invalid == {}


def test_trtllm() -> None:
    s = parse_engine_metrics(TRTLLM_TEXT)
    assert s.ok and s.engine == "trtllm"
    assert (s.running, s.waiting, s.kv_usage) == (5, 0, 0.5)
    assert (s.kv_capacity_tokens, s.kv_used_tokens) == (32000, 16000)


def test_engine_hint_and_detection_tie() -> None:
    mixed = TGI_TEXT + sglang_text()
    assert parse_engine_metrics(mixed).engine == "sglang"  # 3 core names each: order breaks tie
    assert parse_engine_metrics(mixed, engine="tgi").engine == "tgi"
    assert parse_engine_metrics(mixed, engine="nonsense").engine == "sglang"
    only_prefix = "# TYPE vllm:iteration_tokens_total counter\nvllm:iteration_tokens_total 5\n"
    s = parse_engine_metrics(only_prefix)
    assert s.ok and s.engine == "vllm" and s.running is None and s.invalid == {}


# -- validity -------------------------------------------------------------------------------------
# Stale or impossible values must not be served as readings
# (https://github.com/llm-d/llm-d-router/pull/2547).


@pytest.mark.parametrize(
    ("usage", "problem"),
    [
        ("-0.39", "outside [0, 1]"),  # vLLM-Ascend, vllm-project/vllm-ascend#10048
        ("1.7", "outside [0, 1]"),
        ("NaN", "not finite"),
        ("+Inf", "not finite"),
        ("-Inf", "not finite"),
    ],
)
def test_usage_out_of_range_is_invalid_not_idle_nor_full(usage: str, problem: str) -> None:
    s = parse_engine_metrics(vllm_text(usage=usage))
    assert s.ok
    assert s.kv_usage is None  # never 0 (idle) nor 1 (saturated)
    assert problem in s.invalid["kv_usage"] and "vllm:kv_cache_usage_perc" in s.invalid["kv_usage"]
    assert s.kv_used_tokens is None and "kv_used_tokens" in s.invalid
    assert s.kv_capacity_tokens == 32768 and s.running == 3  # the rest stays usable


def test_usage_within_float_slack_is_clamped() -> None:
    assert parse_engine_metrics(vllm_text(usage="1.0000001")).kv_usage == 1.0
    assert parse_engine_metrics(vllm_text(usage="-0.0000001")).kv_usage == 0.0
    assert parse_engine_metrics(vllm_text(usage="1e-300")).kv_usage == 1e-300


@pytest.mark.parametrize(
    ("running", "problem"),
    [("-1.0", "negative"), ("2.5", "not a whole number"), ("NaN", "not finite"), ("+Inf", "")],
)
def test_bad_counts_are_invalid(running: str, problem: str) -> None:
    s = parse_engine_metrics(vllm_text(running=running))
    assert s.running is None and problem in s.invalid["running"]
    assert s.waiting == 1


def test_one_bad_series_invalidates_the_whole_field() -> None:
    text = vllm_text(engines=("0", "1")).replace(
        f'vllm:num_requests_waiting{{engine="1",model_name="{MODEL}"}} 1.0',
        f'vllm:num_requests_waiting{{engine="1",model_name="{MODEL}"}} -3.0',
    )
    s = parse_engine_metrics(text)
    assert s.waiting is None and "negative" in s.invalid["waiting"]  # not a partial sum
    assert s.running == 6


def test_negative_sglang_and_tgi_values() -> None:
    s = parse_engine_metrics(sglang_text(usage="-0.01", used="-5.0"))
    assert s.kv_usage is None and s.kv_used_tokens is None
    assert set(s.invalid) == {"kv_usage", "kv_used_tokens"}
    t = parse_engine_metrics(TGI_TEXT.replace("tgi_queue_size 2", "tgi_queue_size NaN"))
    assert t.waiting is None and "not finite" in t.invalid["waiting"]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n",
        "<html><body>502 Bad Gateway</body></html>",
        "vllm:num_requests_running{engine=",
        'vllm:num_requests_running{engine="0"} three',
        "\x00\x01\x02",
        "# just a comment\n",
        "node_cpu_seconds_total 1.0\n",
        '{"error": "not found"}',
    ],
)
def test_garbage_is_a_whole_invalid_sample(text: str) -> None:
    s = parse_engine_metrics(text)
    assert not s.ok and s.reason
    assert s.engine is None and s.running is None and s.kv_usage is None


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_never_raises_on_arbitrary_text(text: str) -> None:
    s = parse_engine_metrics(text)
    assert isinstance(s, EngineSample)
    assert s.ok or s.reason


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(
        ["vllm:num_requests_running", "vllm:kv_cache_usage_perc", "sglang:token_usage"]
    ),
    st.one_of(st.floats(), st.integers(-(10**20), 10**20).map(str)),
)
def test_never_raises_on_any_value(name: str, value: float | str) -> None:
    s = parse_engine_metrics(f"# TYPE {name} gauge\n{name} {value}\n")
    if s.ok and s.kv_usage is not None:
        assert 0.0 <= s.kv_usage <= 1.0
    if s.ok and s.running is not None:
        assert s.running >= 0


# -- staleness -------------------------------------------------------------------------------------


def test_staleness_transitions() -> None:
    clock = FakeClock(500.0)
    view = EngineView(scrape_interval=5.0, clock=clock)
    assert view.max_age_seconds == 15.0
    r = view.reading("pod-a")
    assert (r.sample, r.reason, r.age_seconds) == (None, "never_scraped", None)

    sample = view.record_text("pod-a", vllm_text())
    assert sample.ok
    assert view.current("pod-a") == sample
    assert view.age_seconds("pod-a") == 0.0

    clock.now += 5.0  # one scrape fails: the sample is still fresh enough
    view.record_error("pod-a", "timeout")
    r = view.reading("pod-a")
    assert r.sample == sample and r.last_error == "timeout" and r.age_seconds == 5.0

    clock.now += 10.0  # exactly max age: still served
    assert view.current("pod-a") == sample
    clock.now += 0.001  # older than max age: invalid, with why
    r = view.reading("pod-a")
    assert r.sample is None and r.reason == "scrape_failed:timeout"
    assert r.age_seconds == pytest.approx(15.001) and r.last_good_at == 500.0

    view.record_text("pod-a", vllm_text(usage="0.5"))  # recovery
    r = view.reading("pod-a")
    assert r.sample is not None and r.sample.kv_usage == 0.5
    assert r.reason is None and r.last_error is None and r.age_seconds == 0.0

    clock.now += 16.0  # no scrape at all since: the scraper is behind
    r = view.reading("pod-a")
    assert r.sample is None and r.reason == "stale" and r.age_seconds == 16.0


def test_failed_or_invalid_scrapes_before_any_good_one() -> None:
    clock = FakeClock(500.0)
    view = EngineView(scrape_interval=1.0, max_age_seconds=2.5, clock=clock)
    view.record_error("pod-b", "connection_refused")
    assert view.reading("pod-b").reason == "scrape_failed:connection_refused"
    view.record_text("pod-b", "<html>oops</html>")
    r = view.reading("pod-b")
    assert r.sample is None and r.reason is not None
    assert r.reason.startswith("scrape_failed:invalid: unparseable")
    assert r.age_seconds is None and r.last_good_at is None


def test_explicit_times_out_of_order_and_forget() -> None:
    view = EngineView(scrape_interval=2.0, clock=lambda: 0.0)
    new = parse_engine_metrics(vllm_text(usage="0.6"))
    old = parse_engine_metrics(vllm_text(usage="0.1"))
    view.record("p", new, at=100.0)
    view.record("p", old, at=99.0)  # a late answer to an earlier scrape: ignored
    view.record_error("p", "timeout", at=98.0)  # ditto
    r = view.reading("p", now=101.0)
    assert r.sample is new and r.last_error is None
    assert view.current("p", now=106.0) is new
    assert view.current("p", now=106.1) is None
    assert view.readings(now=101.0)["p"].age_seconds == 1.0
    assert view.pods() == ["p"]
    view.forget("p")
    assert view.pods() == [] and view.reading("p", now=101.0).reason == "never_scraped"


def test_view_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        EngineView(scrape_interval=0)
    with pytest.raises(ValueError):
        EngineView(scrape_interval=1.0, max_age_seconds=-1)
    with pytest.raises(ValueError):
        EngineView(scrape_interval=float("nan"))
