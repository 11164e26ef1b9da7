"""Retention: `sparring prune` removes old rollouts with their logged calls and grades, in bounded batches."""
