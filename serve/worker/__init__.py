"""The worker: one rank's device, model, KV cache and sampler, driven by SchedulerOutputs."""
