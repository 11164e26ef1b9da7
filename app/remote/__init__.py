"""Remote rollouts: a trainer asks sparring to run a rollout against its model (eval-protocol's contract)."""
