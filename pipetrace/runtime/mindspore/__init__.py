"""The MindSpore backend: the same plans, executor, recorder and trace format as the torch
runtime, with MindSpore (PyNative mode, ``nn.Cell`` stages) doing the work.

- `backend`: `MindSporeBackend` (the `pipetrace.runtime.backend.Backend` of MindSpore: model
  split, reference gradients, recorder, ...) and `MindSporeDemo` (the demo run's process
  lifecycle, model and data, SGD);
- `stage`: one stage's forward, full backward, dx (I) and dw (W) on MindSpore;
- `p2p`: messages over ``mindspore.ops.communication`` (isend/irecv on the mccl backend);
- `api`: `PipelineRunner` for user scripts (the one runner, `pipetrace.runtime.runner`, on
  this backend, plus MindSpore's gradient lists);
- `demo`: the demo model and data drawn from numpy generators;
- `cluster`: the local launcher of MindSpore cases (a scheduler process plus one worker process
  per rank, each running the one demo worker, `pipetrace.runtime.worker`); `worker`: the msrun
  entry of that demo worker;
- `support`: pure-Python checks run before anything starts (is MindSpore installed, are the
  flags supported).

Nothing here imports MindSpore at import time of this package, and nothing outside this
package imports it at all: ``pipetrace --help``, ``schedule`` and ``analyze`` never load it.
See docs/mindspore.md.
"""
