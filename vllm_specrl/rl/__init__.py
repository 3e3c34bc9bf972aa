"""A small RL loop's reusable parts: tasks and rewards, the trainer-side policy, the rollout client."""
