"""Device-side work of a step: batch tensors, vision encoding, the forward pass and sampling."""
