"""sparring's contract and client, at the bottom of the house: nothing here imports the server (`app`).

`wire` is the contract both sides share (the call envelope, id rules and limits, the outcome names);
`loop.run_rollout` is the one rollout loop; `http` talks to a sparring server as the training
service does, with one retry rule for tool calls and grades; `policies` holds the OpenAI model
policies, `canaries` the scripted ones; `evaluate`, `session` and `report` run a dataset and report
on it (behind `sparring eval` and `sparring canary`); `conversation` is the one stored shape of a
rollout's conversation; `client` is the trainers' `Environment`.
`pip install sparring` installs this package alone; `pip install 'sparring[server]'` adds the server.
"""
