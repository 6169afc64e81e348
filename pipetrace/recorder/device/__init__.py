"""Device-side times of steps and P2P ops on accelerators (CUDA events), resolved off the
training thread and put on the recorder's host clock. See docs/device-timing.md.

- `timer.DeviceTimer`: records, resolves and reports (the one entry point for the recorder);
- `anchor`: device time to host time, the drift model;
- `pool.EventPool`: bounded reuse of events;
- `spans`: the records it hands out (`DeviceSpan`, `PendingWork`);
- `classify`: launch-bound or device-bound;
- `protocol`: what a device must offer; `cuda`: torch.cuda's (torch imported lazily).
"""
