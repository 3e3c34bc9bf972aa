"""Draft training: the EAGLE-3 loss, the shared training core, and the offline warm start."""
