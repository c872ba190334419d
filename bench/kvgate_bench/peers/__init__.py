"""``python -m kvgate_bench.peers``: the kvgate sidecar side by side with nginx and LiteLLM on
pinned CPUs, its section of ``docs/benchmarks.md`` rewritten.

``bench`` (the run, the options and ``main``), ``tools`` (nginx, wrk, LiteLLM and the llm-d
simulator, installed on first use), ``servers`` (each arm's server configured, started, pinned
and measured), ``load`` (wrk's load, the streams, the idle connections) and ``report`` (the
tables, ratios and targets, and the section they replace).
"""
