"""The token path: decode worker -> router -> SSE, measured three ways.

    python -m benchmarks.token_path [--quick] [--json PATH] [--only ingest,e2e,latency]
                                    [--profile DIR] [--e2e-step-ms 10] [--latency-rate 200]

1. **ingest** (``ingest.py``, ``producer.py``) -- what one router core absorbs.
   A producer process (on the load core) plays a decode worker: it serves the
   decode websocket on loopback, accepts every start and then blasts
   pre-encoded ``wire.TokenFrame`` messages as fast as the socket takes them.
   The router process (on the router core) runs the package's ``WorkerLink``
   against it (its public ``run()``; each of the 64 streams opened with
   ``WorkerLink.start``) and drains every stream the way a request does: the
   merged delta from the stream's buffer, shaped by ``StreamShaper``, into a
   null ASGI send.  tokens/s and frames/s are normalised to one full core:
   tokens / router CPU seconds (``getrusage`` of the router process).  A frame
   of K tokens is K entries of one token each, for K distinct streams (the
   hard case: per-entry cost); one extra row sends one entry of 16 tokens.
   "tok/SSE chunk" shows how much the stream buffers merged per delivery.
   ``--profile DIR`` adds two runs under py-spy (raw folded stacks in DIR) and
   prints their top functions.
2. **e2e** (``end_to_end.py``, ``sse_clients.py``) -- real ``hypercorn -k trio
   pdtrio.app:app`` pinned to the router core, synthetic prefill and decode
   workers (one token per step, a step every ``--e2e-step-ms``), and 64 / 256
   raw-socket SSE clients in one process (all of the load on the load core),
   each streaming 256-token completions back to back.  After a warm-up, over a
   fixed window: tokens/s delivered (counted in the bytes: a synthetic token's
   text is " t<id>"), router CPU per token (its process tree, from /proc), the
   decode worker's own CPU per token in the same window as a baseline, the load
   core's use, and the inter-token gap a client sees: the time between
   successive socket reads that carried at least one SSE event (per client
   p50/p99, then the median and the worst over clients).
3. **latency** (``light_load.py``) -- light load: one stream at
   ``--latency-rate`` tokens/s through the router, with the decode worker's
   coalescing on and off, while a second request on the same decode worker is
   read straight from its websocket by the same client process.  Both advance
   one token per engine step, so each step is seen twice; "added" is the
   router client's arrival time minus the direct reader's, per step (it can be
   negative: the router has a core of its own, the direct reader shares one
   with the workers).  ITL is the gap between tokens as each reader sees them.

Every process is started through ``pdtrio.testing.Processes`` and stopped by
its own PID when its section ends; each phase has a deadline.  The machine is
small and shared: read the ratios (router vs decode worker in the same run,
coalescing on vs off vs direct) more than the absolute figures.
"""
