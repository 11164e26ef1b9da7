"""sparring for trainers: `sparring.client` runs rollouts against a sparring server (no server stack)."""
