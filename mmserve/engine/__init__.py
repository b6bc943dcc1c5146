"""Engine core: requests, scheduler, paged KV-cache bookkeeping, the step loop."""
