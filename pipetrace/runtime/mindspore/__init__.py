"""The MindSpore backend: the same plans, executor, recorder and trace format as the torch
runtime, with MindSpore (PyNative mode, ``nn.Cell`` stages) doing the work.

- `stage`: one stage's forward, full backward, dx (I) and dw (W) on MindSpore;
- `p2p`: messages over ``mindspore.ops.communication`` (isend/irecv on the mccl backend);
- `api`: `PipelineRunner` for user scripts (the MindSpore twin of `pipetrace.runtime.api`);
- `worker` / `cluster`: the demo training run and its local launcher (a MindSpore scheduler
  process plus one worker process per rank), used by ``pipetrace run --backend mindspore``;
- `support`: pure-Python checks run before anything starts (is MindSpore installed, are the
  flags supported).

Nothing here imports MindSpore at import time of this package, and nothing outside this
package imports it at all: ``pipetrace --help``, ``schedule`` and ``analyze`` never load it.
See docs/mindspore.md.
"""
