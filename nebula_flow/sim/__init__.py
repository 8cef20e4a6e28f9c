"""Profile-driven discrete-event simulation of a nebula-flow deployment (``nebula-flow simulate``).

The simulator drives the live ``Scheduler``; see ``engine.py``. Scenarios: ``scenario.py``.
"""
