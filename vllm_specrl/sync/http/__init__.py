"""Weight sync over ``vllm serve``'s HTTP server: the ``/specrl/update/*`` routes and the
stale-draft guard the status route reports."""
