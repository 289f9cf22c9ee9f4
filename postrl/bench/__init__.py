"""Benchmarks that compare postrl with the plain way, measured side by side in one process.

Not a library layer: these modules sit on top of everything (they may import
``postrl.testing``), and nothing in the library imports them. Each is a ``postrl bench <name>``
command and also runs as ``python -m postrl.bench.<name>``:

- :mod:`postrl.bench.step`: one RL step of the reference workload W1, postrl vs a
  plain-transformers trainer (``postrl bench step``);
- :mod:`postrl.bench.rollout`: rollout only, the native engine vs ``transformers.generate``
  (``postrl bench rollout``);
- :mod:`postrl.bench.modes`: a planner that predicts each ``trainer.mode``'s samples/s and
  staleness from a few measured ``sync`` steps, and extrapolates to N rollout / M trainer
  workers (``postrl bench modes``).

``docs/benchmarks.md`` has the measured numbers and how to read them.
"""
