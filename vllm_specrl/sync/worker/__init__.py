"""The worker side of a weight update: the extension vLLM mixes into every worker, staging and
validation of what arrives, the in-place load and its repairs."""
