"""Building blocks shared by every model: linear (TP-aware), norms, rotary, activations, attention."""
