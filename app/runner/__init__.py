"""The rollout runner: runs models (or scripted canaries) through sparring's tools and grader over HTTP.

`loop.run_rollout` is the one rollout loop (see its module docstring for the interface); `http`
talks to sparring as the training service does; `models` holds the OpenAI policies, `canaries` the
scripted ones; `evaluate` runs a dataset with concurrency, progress, resume and a report; `cli`
holds `sparring eval` and `sparring canary`.
"""
