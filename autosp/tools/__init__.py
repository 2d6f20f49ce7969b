"""Measurement tools: the memory probe, the validation harness, process launch and timing.

Used by benchmarks, tests and the demo; the training runtime never imports them."""
