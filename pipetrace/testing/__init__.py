"""Test doubles that write real traces: a fake cluster of real Recorders on virtual time.

Used by the tests that need no real processes and by the benchmarks' synthetic runs. It sits
outside `pipetrace.analyze` (which only reads traces) and outside `pipetrace.recorder` (which
must not know the runtime's fault declarations that the fake cluster injects).
"""
