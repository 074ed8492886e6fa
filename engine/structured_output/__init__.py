"""Structured output: constrain a request's tokens to a grammar.

A request's ``SamplingParams.structured_outputs`` (``params.py``) names one
constraint: a JSON schema, any JSON object, a regular expression, a choice
among strings, or an EBNF grammar. The ``StructuredOutputManager``
(``manager.py``) compiles it off the engine thread, in a pool, cached by
its key; until then the request waits in ``WAITING_FOR_FSM`` while others
run (the scheduler's path, as the seeds'). Each step it fills one bitmask
row per constrained request that samples; the runner masks those logits
rows (``apply.py``); each accepted token advances the request's matcher.
The grammar library sits behind ``backend.py``'s small interface;
``xgrammar_backend.py`` is the one implementation (see
benchmarks/structured_output_bench.py for why xgrammar).

A schema keeps the client's key order (objects are generated in it), and
one with a keyword the backend would silently drop is refused up front
(``schema_check.py``, which ``params`` runs).

``engine.sched`` imports only ``params`` (with ``schema_check``), ``request``
and ``backend`` (neither numpy nor torch, which tests/unit/test_imports.py
checks).
"""
