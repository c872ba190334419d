"""Real time: one schedule over real HTTP through the real kvgate sidecar and kvgate-sim.

The virtual-time driver (:mod:`kvgate_bench.effectiveness.model.driver`) runs the admission core
and the engine model in one process on a virtual clock. This package runs the same
:class:`~kvgate_bench.effectiveness.model.schedule.Schedule` the way a deployment would (the
schedule and the arms' context built as the virtual-time runner builds them, ``isolation`` at
``--noisy-load K`` included: :mod:`kvgate_bench.effectiveness.realtime.plan`):

* **kvgate-sim** (:mod:`kvgate_bench.sim.server`) serves the engine model on the real clock,
  in a subprocess (``python -m kvgate_bench.sim.cli``: its step loop gets a CPU core of its
  own) or in this process. Its configuration is the virtual driver's
  :func:`~kvgate_bench.effectiveness.model.driver.engine_config` (same profile, KV pool, block
  size, context, ``max_num_seqs``, token budget; :func:`.servers.sim_config` checks they match).
* **arm** ``none``: the client talks to kvgate-sim directly. An arm with a kvgate policy
  (:class:`~kvgate_bench.effectiveness.arms.kvgate_arms.KvgateMaxTokensArm` and its subclasses:
  the ``spec`` of :meth:`~kvgate_bench.effectiveness.arms.kvgate_arms.KvgateMaxTokensArm.policy`)
  puts the real sidecar (:class:`kvgate_agent.sidecar.app.Sidecar`) in front, in this process,
  enforcing that spec as a RateLimitPolicy manifest.
  The other arms have no real-time counterpart here.
* **client**: one aiohttp task per request sends, at the request's arrival time, a streaming
  completion with its tenant in ``x-kvgate-tenant``, its ``max_tokens`` (omitted when the
  schedule has none) and its true output length in the simulator-only header
  ``x-sim-output-tokens`` (the sidecar forwards it untouched, kvgate-sim stops there).

**Prompt tokens.** By default the prompt is a list of ``prompt_tokens`` token ids
(``/v1/completions``): kvgate-sim and the sidecar both count one token per id, exactly the
schedule's count, at no tokenizing cost. With ``chat`` it is a chat completion of one user
message of ``prompt_tokens - 6`` words, which kvgate-sim counts as ``words + 4`` per message
``+ 2`` (exactly the schedule's count); the sidecar is then given a word-level tokenizer (one
token per whitespace-separated word, a temporary ``tokenizer.json``) and counts the words plus
its fixed chat framing (4 per message + 3 for the reply primer): ``prompt_tokens + 1``, one token
more than the virtual-time arm charges. (A prompt under 7 tokens, which the workloads practically
never draw, is sent as an empty message: kvgate-sim then counts 6.) Why token ids by default: the
tokenizer runs on the sidecar's event loop, about 2 us per word here (1.6 ms for the median
conversation prompt of 757 tokens, 16 ms for 7,900), and a burst of long prompts delays the
tokens the sidecar relays and, in this process, the client's next sends (multi-tenant's bursty
arrivals at load 1.5: sends 100-200 ms late).

**What is measured**, per request, on the real clock from the schedule's start: the first
token's time (the first chunk with text: a non-empty ``text``, or ``delta.content`` in chat),
the finish (the chunk carrying ``finish_reason``), the output tokens (chunks with text; each is
one token in kvgate-sim), refusals (any status but 200: 429/503 from the sidecar, 400 from
either), a degradation (``x-kvgate-decision: degraded``, its ``x-kvgate-degraded:
max_tokens=N``), and the times kvgate-sim preempted it (``/sim/preemptions``, by the ``id``
of its chunks). The KV usage is sampled from ``/sim/stats`` every :data:`.client.KV_SAMPLE_S`
seconds. They fill the same
:class:`~kvgate_bench.effectiveness.model.gate.RequestRecord` / ``RunResult`` the virtual driver
builds, so :func:`kvgate_bench.effectiveness.model.metrics.summarize` scores both the same way.

**Time scale.** With ``time_scale`` k > 1 kvgate-sim runs k times slower than the GPU it models
(``SimConfig.time_scale``), the client sends request i at ``k x arrival_s``, every time measured
is divided by k, and the sidecar's admission clock is ``time.monotonic() / k`` (so its queue
timeouts, token buckets and Retry-After are in modelled seconds, as the policy says). The SLOs
(:mod:`kvgate_bench.effectiveness.model.metrics`) then apply unchanged. It lets a small machine keep
up with a load whose token rate it could not stream in real time; the price is k times the wall
time. The HTTP hops' own latency (about a millisecond on loopback) shrinks by k in modelled time.

**Where the two runs differ by design.** In virtual time a request dispatched during a step joins
the engine's queue at once and is scheduled from the next step; over HTTP it joins when its
request has crossed the sidecar (a millisecond or so later), usually the same next step.
kvgate-sim paces its steps to deadlines (its loop's CPU time does not stretch the modelled
timeline) but falls behind when the machine cannot keep up; the client then sends late too.
:attr:`.run.RealtimeRun.kept_up` says whether it kept up (from kvgate-sim's step lag and the
client's send lags); one that did not is no comparison (rerun it with a larger time scale). The
measured times include what HTTP adds: the first token reaches the client a few milliseconds
after the step that made it ended.

The modules, by job: ``plan`` (the schedule and the arms' context, as the virtual-time runner
builds them; the isolation figures compared), ``servers`` (kvgate-sim and the sidecar, started
and stopped), ``client`` (the requests sent and what came back recorded), ``run`` (one run,
measured, and whether the machine kept up), ``agreement`` (virtual next to real: do they agree)
and ``__main__`` (``python -m kvgate_bench.effectiveness.realtime``).
"""
