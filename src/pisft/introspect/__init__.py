"""Tools that study the training step rather than run it.

- `estimate`: parameters and per-device peak memory of pisft's training step, by simulating it on
  fake tensors (`python -m pisft estimate`; the smoke report carries it beside its measurement).
  Its parts: `step_memory` (the storage tracker, which `measure` uses too), `simulated_step`
  (the step on fake tensors) and `micro_batch_fits` (the largest micro batch per mode).
- `measure`: the same step run for real on the CPU, to check the estimate against
  (`python -m pisft.introspect.measure`).
- `collective_audit`: a process group that records every collective and checks its dtypes
  against HCCL's table (the tests' stand-in `hccl` backend, `bench --only train_structure`).
- `synthetic`: their inputs: a full-size policy with random weights and a synthetic batch.

Built on `pisft.train` and `pisft.model`; nothing in a training run's own path imports this
package except the smoke stage's report (tests/test_stages.py's LAYERS).
"""
